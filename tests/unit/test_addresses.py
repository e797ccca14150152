"""Worker addresses with IPv6 literals (threadlog/kernel/addresses.py)."""

from __future__ import annotations

import pytest

from threadlog.kernel import addresses


def test_a_joined_address_splits_back_into_its_host_and_port():
    for host, port in [("127.0.0.1", 7000), ("worker-1.example", 0), ("::1", 7000), ("fe80::1%eth0", 1)]:
        assert addresses.split(addresses.join(host, port)) == (host, port)
    assert addresses.join("::1", 7000) == "[::1]:7000"
    assert addresses.join("10.0.0.1", 7000) == "10.0.0.1:7000"


def test_older_forms_still_split_and_an_address_without_a_port_is_refused():
    assert addresses.split("::1:7000") == ("::1", 7000)  # as workers before brackets announced IPv6
    assert addresses.split("7000") == ("", 7000)  # --listen PORT
    for bad in ("host", "host:x", "[::1]", "", "host:70000", "host:-1", "host:\u00b2", "10.0.0.1:99999"):
        with pytest.raises(ValueError):
            addresses.split(bad)


def test_hosts_a_worker_may_announce():
    for good in ("127.0.0.1", "worker-1", "::1", "[::1]", "2001:db8::7"):
        assert addresses.is_host(good), good
    for bad in ("", "host:1", "a b", "a/b", "::1:7000x", "[::1]:7000", "fe80::zz", "[name]"):
        assert not addresses.is_host(bad), bad
    assert addresses.bare("[::1]") == "::1" and addresses.bare("::1") == "::1"
