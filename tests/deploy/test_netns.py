"""`deploy.netns`: two namespaces joined by a capped veth pair, the user-space delay proxy, and cutting
the link. Skips with the reason where this host cannot create network namespaces (not root, no iproute2)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from deepinfer.deploy.netns import DelayProxy, TwoDatacenters, can_create, enter_netns

_OK, _WHY = can_create()
pytestmark = pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")

SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    c, _ = srv.accept()
    n = 0
    while True:
        d = c.recv(1 << 16)
        if not d:
            break
        n += len(d)
        if d.endswith(b"?"):  # a ping: answer at once
            c.sendall(b"!")
    c.sendall(str(n).encode())
    c.close()
"""


def _in_netns(name: str, fn):
    """Run `fn()` in a thread that entered namespace `name`; returns its result."""
    out: list = []

    def run():
        enter_netns(name)
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.fixture
def link():
    dcs = TwoDatacenters(bandwidth_mbit=40, names=(f"dc-a-{os.getpid()}", f"dc-b-{os.getpid()}"),
                         subnet="10.78.0").create()
    a, b = dcs.names
    sink = dcs.popen(b, [sys.executable, "-c", SINK, dcs.address(b), "7100"], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        yield dcs
    finally:
        sink.kill()
        sink.wait()
        dcs.destroy()


def _send(host: str, port: int, nbytes: int) -> tuple[int, float]:
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=20) as s:
        s.sendall(b"x" * nbytes)
        s.shutdown(socket.SHUT_WR)
        got = int(s.recv(64))
    return got, time.monotonic() - t0


def test_bandwidth_is_capped_between_the_datacenters(link):
    a, b = link.names
    nbytes = 2_000_000
    got, seconds = _in_netns(a, lambda: _send(link.address(b), 7100, nbytes))
    assert got == nbytes
    mbit_s = nbytes * 8 / seconds / 1e6
    assert mbit_s < 40 * 1.25, f"{mbit_s:.1f} Mbit/s over a 40 Mbit/s cap"
    assert mbit_s > 40 * 0.3, f"{mbit_s:.1f} Mbit/s: far below the cap"


def test_delay_proxy_adds_latency_each_way_and_the_link_can_be_cut(link):
    a, b = link.names
    with DelayProxy((link.address(b), 7100), delay_s=0.1, netns=a) as proxy:
        host, port = proxy.address.rsplit(":", 1)

        def ping() -> float:
            with socket.create_connection((host, int(port)), timeout=10) as s:
                t0 = time.monotonic()
                s.sendall(b"?")
                assert s.recv(1) == b"!"
                return time.monotonic() - t0

        rtt = _in_netns(a, ping)
        assert 0.2 <= rtt < 1.0, rtt
    link.set_link(False)
    with pytest.raises(OSError):
        _in_netns(a, lambda: socket.create_connection((link.address(b), 7100), timeout=0.5))
    link.set_link(True)
    got, _ = _in_netns(a, lambda: _send(link.address(b), 7100, 1000))
    assert got == 1000
