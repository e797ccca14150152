"""`threadlog.open(..., kafka={...})`: user librdkafka properties, refusals, secrets, failures in one message."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient
from support import within

import threadlog
from threadlog import ThreadLogError
from threadlog.kernel import kafka_config
from threadlog.kernel.topics import Topics


class Recorder:
    """Wraps a confluent_kafka client class where a threadlog module imported it, keeping each config."""

    def __init__(self) -> None:
        self.confs: list[dict] = []

    def wrap(self, cls):
        def build(conf, *args, **kwargs):
            self.confs.append(dict(conf))
            return cls(conf, *args, **kwargs)

        return build


async def test_properties_reach_every_client_threadlog_creates(open_client, monkeypatch):
    import threadlog.producers.blob_chunks as blob_chunks
    import threadlog.producers.deliveries as deliveries
    import threadlog.producers.proposals as proposals
    import threadlog.projections.follower as follower

    import threadlog.delivery.reader as delivery
    import threadlog.runtime as runtime

    rec = Recorder()
    for module, names in ((delivery, ["Consumer"]), (blob_chunks, ["Producer", "Consumer"]),
                          (deliveries, ["Producer"]), (proposals, ["Producer"]), (follower, ["Consumer"]),
                          (runtime, ["AdminClient"])):
        for name in names:
            monkeypatch.setattr(module, name, rec.wrap(getattr(module, name)))
    tl = await open_client(kafka={"socket.keepalive.enable": "true", "client.rack": "rack-probe"})
    await within(tl.messages.save_thread("t", ["m"]))
    log = tl.delivery("run-1")
    await within(log.append([{"type": "text", "text": "x"}]))
    assert len(await within(log.records("-1"))) >= 1
    await within(tl.blobs.put("b", b"bytes"))
    assert (await within(tl.blobs.get("b"))) is not None
    roles = {c["client.id"].rsplit(".", 1)[-1] for c in rec.confs}
    # admin, judge follower, delivery index, proposals, deliveries, blob writer and reader, delivery reader
    assert {"admin", "follower", "proposals", "deliveries", "blobs", "blob-reader", "dlvread1"} <= roles, roles
    assert all(c.get("client.rack") == "rack-probe" for c in rec.confs)
    # ...and never at the expense of what correctness needs.
    for conf in rec.confs:
        if "acks" in conf:
            assert conf["enable.idempotence"] is True and conf["acks"] == "all"
        if "group.id" in conf:
            assert conf["enable.auto.commit"] is False


async def test_properties_take_effect_in_librdkafka(open_client):
    """An observable effect: statistics.interval.ms + stats_cb make the live clients report themselves."""
    seen: set[tuple[str, str]] = set()
    lock = threading.Lock()

    def on_stats(raw: str) -> None:
        stats = json.loads(raw)
        with lock:
            seen.add((stats["type"], stats["client_id"].rsplit(".", 1)[-1]))

    tl = await open_client(kafka={"statistics.interval.ms": 100, "stats_cb": on_stats})
    await within(tl.messages.save_thread("t", ["m"]))
    deadline = time.monotonic() + 20
    want = {("producer", "proposals"), ("producer", "deliveries"), ("consumer", "follower")}
    while not want <= seen:  # stats arrive every 100 ms from polling clients; bounded
        assert time.monotonic() < deadline, seen
        await within(tl.messages.load_thread("t"))
        with lock:
            if want <= seen:
                break
        await within(tl.read_barrier(None))


# The last four broke the judges' group while open() accepted them (a review: the
# worker exited, its judge thread died, or two workers sharing the file fenced each other).
@pytest.mark.parametrize("prop", ["enable.idempotence", "acks", "isolation.level", "enable.auto.commit",
                                  "group.id", "transactional.id", "bootstrap.servers", "group.protocol",
                                  "partition.assignment.strategy", "group.instance.id", "group.remote.assignor"])
def test_a_property_threadlog_controls_is_refused_naming_it(prop):
    with pytest.raises(ThreadLogError) as err:
        threadlog.open("127.0.0.1:1", kafka={prop: "x"})
    assert err.value.code == "INVALID_ARGUMENT"
    assert repr(prop) in err.value.message


@pytest.mark.parametrize("props, named", [
    ({"no.such.property": "1"}, "no.such.property"),
    ({"socket.timeout.ms": "soon"}, "socket.timeout.ms"),
    ({"linger.ms": "later"}, "linger.ms"),  # librdkafka reports its alias queue.buffering.max.ms
    ({"session.timeout.ms": "x"}, "session.timeout.ms"),  # consumer-only: a producer would not notice
    ({"linger.ms": 5, "security.protocol": "carrier-pigeon"}, "security.protocol"),
    ({"client.rack": ["a", "list"]}, "client.rack"),
])
def test_an_invalid_property_is_refused_at_open_naming_it(props, named):
    with pytest.raises(ThreadLogError) as err:
        threadlog.open("127.0.0.1:1", kafka=props)
    assert err.value.code == "INVALID_ARGUMENT"
    assert repr(named) in err.value.message


async def test_secrets_never_appear_in_errors_reprs_or_logs(bootstrap, namespace, tmp_path, caplog):
    secret = f"s3cret-{uuid.uuid4().hex[:8]}"
    # librdkafka quotes a bad value in its message: here the secret doubles as one.
    with pytest.raises(ThreadLogError) as err:
        threadlog.open("127.0.0.1:1", kafka={"sasl.password": secret, "security.protocol": secret})
    assert "security.protocol" in err.value.message and secret not in str(err.value)

    caplog.set_level(logging.DEBUG, logger="threadlog")
    props = {"sasl.username": "u", "sasl.password": secret, "ssl.key.password": secret}
    async with threadlog.open(bootstrap, namespace=namespace, state_dir=str(tmp_path), kafka=props) as tl:
        await within(tl.messages.save_thread("t", ["m"]))
        assert secret not in repr(tl.opts)
    assert "[redacted]" in caplog.text  # the properties were logged, redacted
    assert secret not in caplog.text
    assert kafka_config.redacted({"my.token": "x", "api.secret.key": "y", "linger.ms": 1}) == {
        "my.token": "[redacted]", "api.secret.key": "[redacted]", "linger.ms": 1}
    # Tried (a review): a real librdkafka secret the list missed was logged in clear.
    for key in ("sasl.oauthbearer.assertion.private.key.passphrase", "sasl.oauthbearer.assertion.private.key.pem",
                "ssl.keystore.password", "sasl.oauthbearer.client.credentials.client.secret"):
        assert kafka_config.is_secret(key), key


async def test_an_unreachable_bootstrap_fails_within_the_timeout_naming_the_cause(tmp_path):
    started = time.monotonic()
    with pytest.raises(ThreadLogError) as err:
        await within(threadlog.open("127.0.0.1:1", namespace="nowhere", state_dir=str(tmp_path),
                                    request_timeout_ms=3000), 30)
    elapsed = time.monotonic() - started
    assert err.value.code == "UNAVAILABLE"
    assert "Connection refused" in err.value.message and "127.0.0.1:1" in err.value.message
    assert elapsed < 3 + 3, elapsed  # the timeout, plus teardown


async def test_create_topics_false_never_creates_a_namespace(bootstrap, namespace, tmp_path):
    with pytest.raises(ThreadLogError) as err:
        await within(threadlog.open(bootstrap, namespace=namespace, state_dir=str(tmp_path),
                                    create_topics=False))
    assert err.value.code == "NAMESPACE_NOT_FOUND" and namespace in err.value.message
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    assert not set(Topics(namespace).all()) & set(md.topics)


async def test_create_topics_false_opens_an_existing_namespace(open_client):
    first = await open_client()
    await within(first.messages.save_thread("t", ["m"]))
    reader = await open_client(create_topics=False, processors="external")
    assert await within(reader.messages.load_thread("t")) == ["m"]


def test_client_properties_files_parse_like_java(tmp_path):
    path = tmp_path / "client.properties"
    path.write_text("# comment\n! also a comment\n\nsecurity.protocol = SASL_SSL\n"
                    "sasl.mechanism:PLAIN\nsasl.jaas.x=a=b\nlong=one,\\\n  two\nblank.separated  v=1\n",
                    encoding="utf-8")
    assert kafka_config.load_properties(str(path)) == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.jaas.x": "a=b", "long": "one,two",
        "blank.separated": "v=1"}
    # Each expectation below is what java.util.Properties.load gave for the same file
    # (Java 17): a comment never continues, a continuation at the end of the file
    # keeps its value, escapes are decoded in keys and values.
    cases = {
        "# see vault \\\nsasl.username=alice\nsasl.password=s3cret\\":
            {"sasl.password": "s3cret", "sasl.username": "alice"},
        "ssl.ca.location=C:\\\\certs\\\\ca.pem\nsasl.password=pa\\=ss\\u00e9\n":
            {"sasl.password": "pa=ss\u00e9", "ssl.ca.location": "C:\\certs\\ca.pem"},
        "a\\:b=c\nx = y \\\n   z\n  indented : v\nk\\ ey=sp\nemoji=\\ud83d\\ude00\n":
            {"a:b": "c", "emoji": "\U0001f600", "indented": "v", "k ey": "sp", "x": "y z"},
        "odd=ends\\\\\\\neven=ends\\\\\nt=tab\\there\n": {"odd": "ends\\even=ends\\", "t": "tab\there"},
    }
    for text, expected in cases.items():
        path.write_text(text, encoding="utf-8")
        assert kafka_config.load_properties(str(path)) == expected, text
    path.write_text("ok=1\nsasl.password-hunter2\n", encoding="utf-8")
    with pytest.raises(ThreadLogError) as err:
        kafka_config.load_properties(str(path))
    assert err.value.code == "INVALID_ARGUMENT" and ":2:" in err.value.message
    assert "hunter2" not in err.value.message
    # Tried (a review): a Latin-1 file was INTERNAL: UnicodeDecodeError, exit 1.
    path.write_bytes(b"client.id=caf\xe9\nsasl.password=caf\xe9s3cret\n")
    with pytest.raises(ThreadLogError) as err:
        kafka_config.load_properties(str(path))
    assert err.value.code == "INVALID_ARGUMENT" and "not UTF-8" in err.value.message, err.value
    assert "s3cret" not in err.value.message
