"""threadlog: durable state for AI agent threads, event-sourced on Apache Kafka."""

from .client import ThreadLog, open
from .errors import ThreadLogError

__all__ = ["ThreadLog", "ThreadLogError", "open"]
__version__ = "0.1.0"
