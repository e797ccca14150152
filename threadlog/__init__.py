"""threadlog: durable state for AI agent threads, event-sourced on Apache Kafka."""

from .client import ThreadLog, open
from .errors import ThreadLogError
from .stores.checkpoints import Writer, WriterLease

__all__ = ["ThreadLog", "ThreadLogError", "Writer", "WriterLease", "open"]
__version__ = "0.1.0"
