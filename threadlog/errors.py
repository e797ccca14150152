"""Re-exports `threadlog.kernel.errors` at its public path `threadlog.errors` (the public API)."""

from threadlog.kernel.errors import *  # noqa: F403
