"""Local Apache Kafka for development, tests and CI (no Docker needed)."""

from .local import (
    KAFKA_VERSION,
    BrokerError,
    BrokerState,
    ClusterState,
    NodeStatus,
    default_data_dir,
    kill_node,
    live_brokers,
    node_count,
    nodes_status,
    resolve_jars,
    restart_node,
    start,
    status,
    stop,
    stop_node,
)

__all__ = [
    "KAFKA_VERSION",
    "BrokerError",
    "BrokerState",
    "ClusterState",
    "NodeStatus",
    "default_data_dir",
    "kill_node",
    "live_brokers",
    "node_count",
    "nodes_status",
    "resolve_jars",
    "restart_node",
    "start",
    "status",
    "stop",
    "stop_node",
]
