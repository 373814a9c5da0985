"""Two emulated datacenters on one host: network namespaces `dc-a` and `dc-b` joined by a veth pair
whose both ends are capped by `tc tbf`, plus a user-space TCP delay proxy for the link's latency.

```python
link = TwoDatacenters(bandwidth_mbit=400).create()       # needs root (CAP_NET_ADMIN)
link.popen("dc-a", [sys.executable, "-m", "deepinfer.prefill_worker", "--host", link.address("dc-a"), ...])
with DelayProxy(("10.77.0.2", 7002), delay_s=0.005, netns="dc-a") as proxy:  # dc-a -> dc-b, +5 ms each way
    ...                                                   # connect to proxy.address from dc-a
link.destroy()
```

Why user space for the latency: tc netem is not built into every kernel (it is not on the CI
machines), while veth, network namespaces and tbf are. `DelayProxy` holds every chunk it forwards
for `delay_s` in each direction (bytes keep their order and are not throttled by the proxy itself;
the tbf cap of the veth still applies behind it), so a request/response over it pays 2 x delay_s.
Control-plane traffic (gRPC) goes through such proxies; a NIXL/UCX TCP transfer opens its own
connections and sees only the bandwidth cap.

`deploy/configs/two_datacenters.yaml` maps onto it: the prefill groups (datacenter `dc-a`) and their
balancer run in `dc-a`, the decode groups (`dc-b`) and theirs in `dc-b`, the entrypoint in either.
`can_create()` says whether this host allows it (the tests skip with its reason otherwise).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence

DATACENTERS = ("dc-a", "dc-b")
"""Namespace names, as in deploy/configs/two_datacenters.yaml."""


CLONE_NEWNET = 0x40000000
"""setns(2)'s flag for a network namespace (os.setns only exists from Python 3.12)."""


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name` (`ip netns` bind mount); raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=False)


def can_create() -> tuple[bool, str]:
    """Whether this process can create network namespaces, veth pairs and tbf qdiscs; (False, why) if not."""
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"the {tool!r} tool (iproute2) is not installed"
    probe = f"dinf-probe-{os.getpid()}"
    r = _run("ip", "netns", "add", probe)
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe)
    return True, ""


class TwoDatacenters:
    """Namespaces `names[0]` and `names[1]` joined by a veth pair (`subnet`.1 and .2), each end capped
    at `bandwidth_mbit` by tbf. `create()` / `destroy()` (idempotent); a context manager too."""

    def __init__(self, bandwidth_mbit: float = 400.0, names: Sequence[str] = DATACENTERS,
                 subnet: str = "10.77.0", burst_kbit: int = 256, tbf_latency_ms: int = 50) -> None:
        if bandwidth_mbit <= 0:
            raise ValueError(f"bandwidth_mbit must be > 0, got {bandwidth_mbit}")
        self.bandwidth_mbit = bandwidth_mbit
        self.names = tuple(names)
        self.subnet = subnet
        self.burst_kbit = burst_kbit
        self.tbf_latency_ms = tbf_latency_ms
        suffix = f"{os.getpid() % 100000}"
        self._veths = (f"va{suffix}", f"vb{suffix}")  # interface names stay under 15 characters
        self.is_created = False

    def address(self, name: str) -> str:
        """The IPv4 address of namespace `name` on the link."""
        return f"{self.subnet}.{self.names.index(name) + 1}"

    def device(self, name: str) -> str:
        """The link's interface inside namespace `name` (for UCX_NET_DEVICES: NIXL over TCP on the link)."""
        return self._veths[self.names.index(name)]

    def ucx_env(self, name: str) -> dict[str, str]:
        """UCX variables that keep a process of namespace `name` on TCP over the link (no shared-memory
        or cross-memory-attach shortcut between the 'datacenters')."""
        return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": self.device(name)}

    def create(self) -> TwoDatacenters:
        """Create both namespaces, the veth pair and the caps; raises RuntimeError naming the failed command."""
        self.destroy()
        a, b = self.names
        va, vb = self._veths
        steps = [
            ("ip", "netns", "add", a), ("ip", "netns", "add", b),
            ("ip", "link", "add", va, "type", "veth", "peer", "name", vb),
            ("ip", "link", "set", va, "netns", a), ("ip", "link", "set", vb, "netns", b),
            ("ip", "-n", a, "addr", "add", f"{self.address(a)}/24", "dev", va),
            ("ip", "-n", b, "addr", "add", f"{self.address(b)}/24", "dev", vb),
            ("ip", "-n", a, "link", "set", "lo", "up"), ("ip", "-n", b, "link", "set", "lo", "up"),
            ("ip", "-n", a, "link", "set", va, "up"), ("ip", "-n", b, "link", "set", vb, "up"),
        ]
        for ns, dev in ((a, va), (b, vb)):
            steps.append(("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                          f"{self.bandwidth_mbit}mbit", "burst", f"{self.burst_kbit}kbit", "latency",
                          f"{self.tbf_latency_ms}ms"))
        self.is_created = True
        for step in steps:
            r = _run(*step)
            if r.returncode != 0:
                self.destroy()
                raise RuntimeError(f"`{' '.join(step)}` failed: {r.stderr.strip()}")
        return self

    def set_link(self, is_up: bool) -> None:
        """Cut (False) or restore (True) the link between the datacenters (both veth ends)."""
        for ns, dev in zip(self.names, self._veths):
            r = _run("ip", "-n", ns, "link", "set", dev, "up" if is_up else "down")
            if r.returncode != 0:
                raise RuntimeError(f"cannot set {dev} in {ns} {'up' if is_up else 'down'}: {r.stderr.strip()}")

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside namespace `name`."""
        return ["ip", "netns", "exec", name, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside namespace `name` (kwargs as `subprocess.Popen`'s)."""
        return subprocess.Popen(self.command(name, argv), **kwargs)

    def destroy(self) -> None:
        """Delete the namespaces (which deletes the veth pair); ignores what does not exist."""
        for name in self.names:
            _run("ip", "netns", "del", name)
        self.is_created = False

    def __enter__(self) -> TwoDatacenters:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()


class DelayProxy:
    """A TCP forwarder listening on `listen` (host, port; port 0 = ephemeral) that connects each client
    to `target` and delays every chunk by `delay_s` in each direction (threads; order kept).

    `netns`: the namespace to listen and connect in (entered by this process's proxy threads through
    `setns`, so only while they run; None = the current one)."""

    def __init__(self, target: tuple[str, int], delay_s: float, listen: tuple[str, int] = ("127.0.0.1", 0),
                 netns: str | None = None) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target = target
        self.delay_s = delay_s
        self.netns = netns
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._listen = listen
        self.address = ""
        self._thread = threading.Thread(target=self._serve, name="delay-proxy", daemon=True)

    def start(self) -> DelayProxy:
        """Blocks until the proxy listens; `address` is its host:port. Raises what prevented it."""
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def _enter_netns(self) -> None:
        if self.netns is not None:
            enter_netns(self.netns)  # this thread only

    def _serve(self) -> None:
        try:
            self._enter_netns()
            server = socket.create_server(self._listen)
            server.settimeout(0.2)
            self.address = f"{self._listen[0]}:{server.getsockname()[1]}"
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        with server:
            while not self._stop.is_set():
                try:
                    client, _ = server.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            self._enter_netns()
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Read chunks into a queue stamped with their due time; a sender thread writes each when due."""
        due: deque = deque()
        cond = threading.Condition()
        is_closed = [False]

        def send() -> None:
            while True:
                with cond:
                    while not due and not is_closed[0]:
                        cond.wait()
                    if not due:
                        break
                    when, data = due[0]
                wait = when - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with cond:
                    due.popleft()
                try:
                    dst.sendall(data)
                except OSError:
                    break
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            while not self._stop.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                with cond:
                    due.append((time.monotonic() + self.delay_s, data))
                    cond.notify()
        except OSError:
            pass
        with cond:
            is_closed[0] = True
            cond.notify()

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
