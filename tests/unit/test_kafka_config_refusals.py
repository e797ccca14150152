"""A refused kafka config names the properties at fault, on one line, secrets scrubbed.

No broker: `check()` and `validate()` judge the properties before anything
connects (README "Configuration"). An operator review found a bad
`sasl.mechanism` blamed on `security.protocol`, and of two forbidden
properties only the first named.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import threadlog
from threadlog.kernel import kafka_config
from threadlog.kernel.errors import ThreadLogError

SECRET = "s3cret-Hunter2"
SASL = {"security.protocol": "SASL_PLAINTEXT", "sasl.username": "u", "sasl.password": SECRET}


def refusal(props: Mapping[str, Any]) -> str:
    """The INVALID_ARGUMENT message of `props`, as `open` and the CLI judge them."""
    with pytest.raises(ThreadLogError) as err:
        kafka_config.validate("127.0.0.1:1", kafka_config.check(props))
    assert err.value.code == "INVALID_ARGUMENT", err.value
    message = err.value.message
    assert "\n" not in message and "\r" not in message, repr(message)
    assert SECRET not in str(err.value), message
    return message


def blamed(message: str) -> str:
    """What the message blames: the text before librdkafka's own words."""
    return message.split(" refused by librdkafka: ", 1)[0]


@pytest.mark.parametrize("props, culprit", [
    # The review's case: alone, security.protocol=SASL_PLAINTEXT lacks
    # credentials, so a probe of each property alone blamed it.
    ({**SASL, "sasl.mechanism": "BOGUS"}, "sasl.mechanism"),
    ({"sasl.mechanism": "BOGUS", **SASL}, "sasl.mechanism"),
    ({**SASL, "sasl.mechanisms": "BOGUS"}, "sasl.mechanisms"),  # the alias, as spelled
    ({**SASL, "sasl.mechanism": "plain"}, "sasl.mechanism"),  # mechanisms are case-sensitive
    ({**SASL, "security.protocol": "SASL_SSL", "sasl.mechanism": "BOGUS"}, "sasl.mechanism"),
    ({"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "bogus"},
     "ssl.endpoint.identification.algorithm"),
    ({"ssl.endpoint.identification.algorithm": "bogus", "security.protocol": "SSL"},
     "ssl.endpoint.identification.algorithm"),
    ({**SASL, "security.protocol": "BOGUS"}, "security.protocol"),
    ({"security.protocol": "SSL", "ssl.ca.location": "/nonexistent/ca.pem"}, "ssl.ca.location"),
    ({"fetch.max.bytes": 100}, "fetch.max.bytes"),  # the consumer's check, in backquotes
    ({**SASL, "sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.method": "oidc"}, "sasl.oauthbearer.method"),
    ({"linger.ms": "later", **SASL, "sasl.mechanism": "PLAIN"}, "linger.ms"),  # reported as an alias
    ({"compression.type": "bogus"}, "compression.type"),  # reported as compression.codec
])
def test_the_property_at_fault_is_the_one_named(props, culprit):
    message = refusal(props)
    assert blamed(message) == f"kafka property {culprit!r}", message


def test_an_unsupported_mechanism_of_this_build_names_the_mechanism():
    # The librdkafka of confluent-kafka's Linux wheels is built without GSSAPI
    # (Kerberos). Not skipped when a build has it: this then fails, and says so.
    props = {**SASL, "sasl.mechanism": "GSSAPI"}
    assert blamed(refusal(props)) == "kafka property 'sasl.mechanism'"


@pytest.mark.parametrize("props", [
    {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"},
    {"sasl.mechanism": "SCRAM-SHA-256", "security.protocol": "SASL_PLAINTEXT"},
])
def test_missing_credentials_blame_no_property_given(props):
    """librdkafka wants sasl.username and sasl.password: neither given property is wrong."""
    message = refusal(props)
    assert blamed(message) == "kafka properties", message
    assert "sasl.username and sasl.password must be set" in message


def test_a_range_refusal_is_one_line():
    # librdkafka ends this one with a newline.
    message = refusal({"linger.ms": -5})
    assert message.endswith("outside allowed range 0..900000"), repr(message)


def test_a_secret_quoted_by_librdkafka_is_scrubbed_and_its_key_not_blamed_by_value():
    message = refusal({"sasl.password": SECRET, "security.protocol": SECRET})
    assert blamed(message) == "kafka property 'security.protocol'", message
    assert kafka_config.REDACTED in message


def test_every_forbidden_property_is_named_in_the_order_given():
    message = refusal({"sasl.password": SECRET, "enable.idempotence": "false", "linger.ms": 5, "acks": "1"})
    assert message.startswith("kafka properties 'enable.idempotence', 'acks' cannot be overridden: "), message
    assert message.index(kafka_config.FORBIDDEN["enable.idempotence"]) < message.index(
        kafka_config.FORBIDDEN["acks"]), message
    reverse = refusal({"acks": "1", "enable.idempotence": "false"})
    assert reverse.startswith("kafka properties 'acks', 'enable.idempotence' cannot be overridden: "), reverse


def test_forbidden_properties_are_all_named_before_other_complaints():
    message = refusal({"client.rack": ["a", "list"], "group.id": "g", "sasl.password": SECRET,
                       "auto.offset.reset": "latest", "transactional.id": "t"})
    for key in ("group.id", "auto.offset.reset", "transactional.id"):
        assert repr(key) in message, message
    assert "client.rack" not in message, message


def test_one_forbidden_property_keeps_its_message():
    assert refusal({"acks": "1"}) == f"kafka property 'acks' cannot be overridden: {kafka_config.FORBIDDEN['acks']}"


def test_open_names_every_forbidden_property():
    with pytest.raises(ThreadLogError) as err:
        threadlog.open("127.0.0.1:1", kafka={"enable.idempotence": False, "acks": 1, "sasl.password": SECRET})
    assert err.value.code == "INVALID_ARGUMENT"
    assert "'enable.idempotence', 'acks'" in err.value.message and SECRET not in str(err.value)


def test_open_names_the_mechanism():
    with pytest.raises(ThreadLogError) as err:
        threadlog.open("127.0.0.1:1", kafka={**SASL, "sasl.mechanism": "BOGUS"})
    assert err.value.code == "INVALID_ARGUMENT"
    assert blamed(err.value.message) == "kafka property 'sasl.mechanism'", err.value.message


@pytest.mark.parametrize("text, named", [
    (f"security.protocol=SASL_PLAINTEXT\nsasl.mechanism=BOGUS\nsasl.username=u\nsasl.password={SECRET}\n",
     "kafka property 'sasl.mechanism' refused by librdkafka"),
    (f"enable.idempotence=false\nsasl.password={SECRET}\nacks=1\n",
     "kafka properties 'enable.idempotence', 'acks' cannot be overridden"),
])
def test_the_cli_says_it_in_one_coded_line(tmp_path: Path, text, named):
    path = tmp_path / "client.properties"
    path.write_text(text, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "threadlog.cli", "namespaces", "list", "--bootstrap", "127.0.0.1:1",
         "--kafka-config", str(path)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "THREADLOG_KAFKA_CONFIG": ""})
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"threadlog: INVALID_ARGUMENT: {named}"), proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
