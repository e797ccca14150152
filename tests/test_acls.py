"""threadlog on a broker that enforces ACLs: `threadlog broker start --sasl --acls`.

A broker of its own for this module (never the shared test broker), its
authorizer denying whatever no ACL allows. SCRAM users are given the README's
ACL rows (or fewer) on this module's namespace prefix over the PLAINTEXT
listener, a super user's; every client here talks to the SASL listener only.
Found by a review with such a broker: a principal without Create could not
open an existing namespace, and one without Write saw its writes wait out the
whole timeout (a blob put never ended) after librdkafka failed its producer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from support import within
from test_secured_cluster import _free_port_block

import threadlog
from threadlog import ThreadLogError, broker
from threadlog.kernel.errors import UNAVAILABLE

ROOT = Path(__file__).resolve().parent.parent
PREFIX = f"acl{uuid.uuid4().hex[:8]}"  # every namespace of this module starts so
USERS = {name: f"pw-{name}-{uuid.uuid4().hex[:8]}" for name in ("app", "nocreate", "readonly")}
SERVICE_TOPIC_OPS = ("READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")
TIMEOUT_MS = 8_000


class AclBroker:
    def __init__(self, bootstrap: str, sasl: str) -> None:
        self.bootstrap = bootstrap  # PLAINTEXT: the operator's (a super user)
        self.sasl = sasl

    @staticmethod
    def props(user: str) -> dict[str, str]:
        return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
                "sasl.username": user, "sasl.password": USERS[user]}


def _allow(admin: AdminClient, user: str, kind: ResourceType, ops: tuple[str, ...]) -> None:
    bindings = [AclBinding(kind, PREFIX, ResourcePatternType.PREFIXED, f"User:{user}", "*",
                           getattr(AclOperation, op), AclPermissionType.ALLOW) for op in ops]
    for fut in admin.create_acls(bindings).values():
        fut.result(30)


@pytest.fixture(scope="module")
def acl_broker() -> Iterator[AclBroker]:
    data_dir = ROOT / ".state" / f"acl-test-{uuid.uuid4().hex[:8]}"
    try:
        st = broker.start(port=_free_port_block(3), data_dir=data_dir, sasl=True, acls=True, timeout=120,
                          log=lambda m: None)
        assert isinstance(st, broker.BrokerState) and st.sasl_bootstrap is not None and st.acls
        for user, password in USERS.items():
            broker.create_scram_user(st.bootstrap, user, password)
        admin = AdminClient({"bootstrap.servers": st.bootstrap})
        # The README's rows: services (app: with Create; nocreate: without), read-only tools.
        _allow(admin, "app", ResourceType.TOPIC, (*SERVICE_TOPIC_OPS, "CREATE"))
        _allow(admin, "nocreate", ResourceType.TOPIC, SERVICE_TOPIC_OPS)
        _allow(admin, "readonly", ResourceType.TOPIC, ("READ", "DESCRIBE"))
        for user in USERS:
            _allow(admin, user, ResourceType.GROUP, ("READ", "DESCRIBE"))
        yield AclBroker(st.bootstrap, st.sasl_bootstrap)
    finally:
        broker.stop(data_dir, timeout=20)
        import shutil

        shutil.rmtree(data_dir, ignore_errors=True)


async def _open(acl_broker: AclBroker, user: str, ns: str, tmp_path: Path, **kwargs) -> threadlog.ThreadLog:
    return await within(threadlog.open(acl_broker.sasl, namespace=ns, kafka=acl_broker.props(user),
                                       state_dir=str(tmp_path / f"{user}-{uuid.uuid4().hex[:6]}"),
                                       request_timeout_ms=TIMEOUT_MS, **kwargs), 60)


async def test_a_service_without_create_opens_a_namespace_that_exists(acl_broker, tmp_path):
    """Tried (a review): every open asked to create every topic, so a principal
    without Create -- the README's deploy-job setup -- failed TOPIC_AUTHORIZATION_FAILED
    (as a retryable UNAVAILABLE) on a namespace whose topics all existed."""
    ns = f"{PREFIX}-exists"
    with pytest.raises(ThreadLogError) as err:  # it may not create one: said so, not retryable
        await _open(acl_broker, "nocreate", ns, tmp_path)
    assert (err.value.code, err.value.retryable) == (UNAVAILABLE, False), err.value
    assert "needs Create" in err.value.message
    async with await _open(acl_broker, "app", ns, tmp_path) as app:
        await within(app.messages.save_thread("t", ["by app"]))
    async with await _open(acl_broker, "nocreate", ns, tmp_path) as service:  # create_topics=True, the default
        assert await within(service.messages.load_thread("t")) == ["by app"]
        await within(service.messages.save_thread("t", ["by a service"]))
        assert await within(service.messages.load_thread("t")) == ["by a service"]


async def test_a_principal_that_may_not_write_fails_its_writes_at_once_and_for_good(acl_broker, tmp_path):
    """Tried (a review): librdkafka fails an idempotent producer whose principal may
    write nowhere (CLUSTER_AUTHORIZATION_FAILED); its poll raised that and the
    thread polling it died, so no delivery report came again: a save waited the
    whole timeout to say OUTCOME_UNKNOWN ("may still apply", for a write that
    never can), and a blob put never ended. Reads work; writes fail, not retryable."""
    ns = f"{PREFIX}-readonly"
    async with await _open(acl_broker, "app", ns, tmp_path) as app:
        await within(app.messages.save_thread("t", ["by app"]))
    async with await _open(acl_broker, "readonly", ns, tmp_path, create_topics=False) as ro:
        assert await within(ro.messages.load_thread("t")) == ["by app"]
        for write in (lambda: ro.messages.save_thread("t", ["by a reader"]),
                      lambda: ro.blobs.put("b", b"x" * 2_000_000)):
            began = time.monotonic()
            with pytest.raises(ThreadLogError) as err:
                await within(write(), 60)
            assert (err.value.code, err.value.retryable) == (UNAVAILABLE, False), err.value
            assert time.monotonic() - began < TIMEOUT_MS / 1000, "waited out the request timeout"
        assert await within(ro.messages.load_thread("t")) == ["by app"]
