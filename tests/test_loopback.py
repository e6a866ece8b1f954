"""The loopback check (tests/loopback.py) can fail: a server bound to every interface is named; one on 127.0.0.1 or
::1 passes. The services themselves are checked where they start: tests/test_s3.py (SeaweedFS), tests/test_ray.py
(a `ray start` cluster, and kvgraft's own local Ray instance)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from loopback import assert_loopback_only, is_loopback, listeners, with_descendants

SERVE = "import socket, sys, time; s = socket.socket(socket.{family}); s.bind(({host!r}, 0)); s.listen(); " \
        "print(s.getsockname()[1], flush=True); time.sleep(60)"  # fmt: skip


def _serve(host: str, family: str = "AF_INET"):
    p = subprocess.Popen(
        [sys.executable, "-c", SERVE.format(host=host, family=family)], stdout=subprocess.PIPE, text=True
    )
    port = int(p.stdout.readline())
    return p, port


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_server_on_every_interface_fails_the_check(host):
    if host == "::" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    p, port = _serve(host, "AF_INET6" if ":" in host else "AF_INET")
    try:
        found = listeners(with_descendants([p.pid]))
        assert [x.port for x in found] == [port]
        with pytest.raises(AssertionError, match=f"listens off loopback: python.* on {host}:{port}"):
            assert_loopback_only(found, "the test server")
    finally:
        p.kill()
        p.wait()


def test_a_server_on_loopback_passes_and_nothing_seen_fails():
    p, port = _serve("127.0.0.1")
    try:
        assert_loopback_only(listeners(with_descendants([p.pid])), "the test server")
    finally:
        p.kill()
        p.wait()
    with pytest.raises(AssertionError, match="nothing was checked"):
        assert_loopback_only([], "a service")


def test_what_counts_as_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1", "fe80::1%eth0"]))
