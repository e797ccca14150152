"""Instructions per judged checkpoint append: `judge_cpu.py` under valgrind, deterministic.

    .venv/bin/python bench/judge_instructions.py [--files 8] [--small 200] [--large 1000]

CPU time on a shared 2-core VM moves by 2x from one hour to the next, which
hides a 5% change in the judging path. The number of instructions executed
does not: this runs `judge_cpu.py` twice under `valgrind --tool=cachegrind`
(no cache simulation), with `--small` and `--large` appends, and prints
(I(large) - I(small)) / (large - small) -- start-up, imports and the lease
grants cancel out. Two runs of the same code agree within 0.1%. About 40 s.
Needs valgrind (`apt-get install valgrind`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def instructions(appends: int, files: int) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, str(HERE / "judge_cpu.py"), "--appends", str(appends), "--files", str(files)],
        capture_output=True, text=True, check=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if found is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--large", type=int, default=1000)
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    small, large = instructions(args.small, args.files), instructions(args.large, args.files)
    per = (large - small) / (args.large - args.small)
    print(f"{per / 1e6:.3f} M instructions per checkpoint append judged ({args.files} files)")


if __name__ == "__main__":
    main()
