"""Local Apache Kafka for development, tests and CI (no Docker needed)."""

from .local import (
    KAFKA_VERSION,
    BrokerError,
    BrokerState,
    default_data_dir,
    resolve_jars,
    start,
    status,
    stop,
)

__all__ = [
    "KAFKA_VERSION",
    "BrokerError",
    "BrokerState",
    "default_data_dir",
    "resolve_jars",
    "start",
    "status",
    "stop",
]
