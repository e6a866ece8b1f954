"""Where the services the tests start listen (TCP): loopback only (127.0.0.0/8, ::1, or IPv4-mapped loopback).

The tests' traffic stays on this machine: SeaweedFS, the Ray clusters (`ray start` and kvgraft's own local instance)
are each checked with :func:`assert_loopback_only` on the processes they run, and tests/test_loopback.py shows the
check failing on a server bound to every interface.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str
    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.name} (pid {self.pid}) on {self.ip}:{self.port}"


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1 and ::ffff:127.x (an IPv6 socket bound to an IPv4 loopback address); never 0.0.0.0 or ::."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def with_descendants(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and every process they started (gone ones left out)."""
    out: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            for q in [p, *p.children(recursive=True)]:
                out[q.pid] = q
        except psutil.NoSuchProcess:
            continue
    return list(out.values())


def listeners(procs: Iterable[psutil.Process]) -> list[Listener]:
    """Every TCP socket in LISTEN of ``procs`` (processes that ended meanwhile skipped)."""
    found = []
    for p in procs:
        try:
            name = p.name()
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found.append(Listener(p.pid, name, c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def off_loopback(found: Iterable[Listener]) -> list[Listener]:
    return [x for x in found if not is_loopback(x.ip)]


def assert_loopback_only(found: list[Listener], what: str) -> None:
    """Fail naming every socket of ``what`` bound elsewhere than loopback; fail too if nothing was seen listening
    (a check of no sockets proves nothing)."""
    assert found, f"{what}: no listening socket seen, so nothing was checked"
    bad = off_loopback(found)
    assert not bad, f"{what} listens off loopback: " + ", ".join(map(str, bad))


def watch(pid: int, until: Callable[[], bool], every_s: float = 0.05) -> list[Listener]:
    """Poll the listeners of ``pid`` and its descendants until ``until()`` holds (say, the process exited); every
    socket seen at any poll, once each."""
    seen: dict[tuple, Listener] = {}
    while True:
        for x in listeners(with_descendants([pid])):
            seen[(x.pid, x.ip, x.port)] = x
        if until():
            return list(seen.values())
        time.sleep(every_s)
