"""A real browser (headless Chromium, Selenium) against `examples/chat_app.py`.

The page sends a message, and is reloaded while the answer streams. The
reloaded page hydrates the thread, rejoins the run through `@tanstack/ai-client`
and must end with the canned answer exactly once: no gap, no repeated word.
Chromium comes from Debian (`scripts/setup` installs it when run as root);
without it this test fails, it never skips.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from example_support import EXAMPLES, ExampleProcess
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from support import within

sys.path.insert(0, str(EXAMPLES))
from chat_app import ANSWER, tokens  # the example's own answer, not a copy

CHROMIUM = os.environ.get("THREADLOG_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("THREADLOG_CHROMEDRIVER", "/usr/bin/chromedriver")
TOKEN_DELAY = 0.15  # s per word: the answer takes ~5 s, long enough to reload in the middle of it


def _start_browser() -> webdriver.Chrome:
    for path in (CHROMIUM, CHROMEDRIVER):
        assert Path(path).exists(), (f"{path} is missing: `apt-get install chromium chromium-driver` "
                                     "(scripts/setup does it when run as root)")
    options = Options()
    options.binary_location = CHROMIUM
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager never tries to download one (no internet here).
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(20)
    return driver


def _assistant_text(driver: webdriver.Chrome) -> str | None:
    found = driver.find_elements(By.CSS_SELECTOR, ".msg[data-role=assistant]")
    return found[0].get_attribute("textContent") if found else None


def _ready(driver: webdriver.Chrome) -> bool:
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true"


def _run_state(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.ID, "status").get_attribute("data-run-state")


def _chat_in_browser(url: str) -> dict:
    """Blocking Selenium steps (run in a thread: the test's event loop stays free)."""
    driver = _start_browser()
    seen: dict = {}

    def wait(condition, what: str, seconds: float = 20):
        try:
            return WebDriverWait(driver, seconds, poll_frequency=0.02).until(lambda d: condition(d))
        except TimeoutException:
            console = [e.get("message") for e in driver.get_log("browser")]
            raise AssertionError(f"timed out after {seconds}s waiting for {what}; page text: "
                                 f"{driver.find_element(By.TAG_NAME, 'body').text!r}; console: {console}") from None

    try:
        driver.get(url + "?threadId=browser-chat")
        wait(_ready, "the first hydrate")
        driver.find_element(By.ID, "prompt").send_keys("Tell me about reloads")
        driver.find_element(By.ID, "send").click()
        # Mid-answer: some words shown, the run not finished.
        wait(lambda d: len((_assistant_text(d) or "").split()) >= 5, "five words of the answer")
        seen["before_reload"] = _assistant_text(driver)
        seen["state_before_reload"] = _run_state(driver)
        seen["run_id"] = driver.find_element(By.ID, "status").get_attribute("data-run-id")

        driver.refresh()
        wait(_ready, "the reload's hydrate")
        # The reloaded page rejoined a run still in progress: a partial answer, still streaming.
        wait(lambda d: _run_state(d) in ("streaming", "finished"), "the reloaded page to join the run")
        seen["state_after_reload"] = _run_state(driver)
        seen["after_reload"] = _assistant_text(driver)
        wait(lambda d: _run_state(d) == "finished", "the end of the answer", 30)
        seen["final"] = _assistant_text(driver)
        seen["assistant_messages"] = len(driver.find_elements(By.CSS_SELECTOR, ".msg[data-role=assistant]"))
        seen["user_messages"] = [e.get_attribute("textContent")
                                 for e in driver.find_elements(By.CSS_SELECTOR, ".msg[data-role=user]")]
        seen["rejoined_run"] = driver.find_element(By.ID, "status").get_attribute("data-run-id")
        seen["console_errors"] = [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    finally:
        driver.quit()
    return seen


@pytest.fixture
async def chat_url(bootstrap, namespace, tmp_path):
    app = await ExampleProcess("chat_app.py", "--bootstrap", bootstrap, "--namespace", namespace, "--port", "0",
                               "--state-dir", str(tmp_path / "app-state"), "--token-delay", str(TOKEN_DELAY),
                               log_dir=tmp_path).start()
    try:
        line = await app.wait_for("chat example at http://", 60)
        yield line.split(" at ", 1)[1].strip()
    finally:
        await app.stop()


async def test_reload_mid_answer_continues_the_answer_once(chat_url, open_client):
    seen = await within(asyncio.to_thread(_chat_in_browser, chat_url), 90)

    # The reload happened mid-answer: a strict prefix was on screen, the run still going.
    assert seen["state_before_reload"] == "streaming", seen
    assert ANSWER.startswith(seen["before_reload"]) and seen["before_reload"] != ANSWER, seen
    assert seen["state_after_reload"] == "streaming", seen  # joined while running, not after the end
    assert seen["rejoined_run"] == seen["run_id"]
    # One assistant message, the whole answer, each word once; the user's message once (hydrated).
    assert seen["final"] == ANSWER
    assert seen["assistant_messages"] == 1
    assert seen["user_messages"] == ["Tell me about reloads"]
    assert seen["console_errors"] == []

    # What the page showed is what the run's delivery log holds, read by another host.
    reader = await open_client()
    chunks = [c async for _, c in reader.delivery(seen["run_id"]).read("-1", follow=False)]
    deltas = [c["delta"] for c in chunks if c["type"] == "TEXT_MESSAGE_CONTENT"]
    assert deltas == tokens()
    assert chunks[-1]["type"] == "RUN_FINISHED"


async def test_a_send_threadlog_refuses_is_a_400_not_a_500(chat_url):
    """Tried (a review): an empty threadId passed the example's own check, and
    threadlog's INVALID_ARGUMENT reached the server as a 500 with a traceback.
    (No browser needed: the page's POST, made directly.)"""
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{chat_url.rstrip('/')}/api/send", json={"threadId": "", "text": "x"})
    assert r.status_code == 400 and r.json()["code"] == "INVALID_ARGUMENT", r.text
