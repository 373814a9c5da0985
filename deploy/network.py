"""The cluster network as a bind address: a YAML `host:` may name a network (`10.0.0.0/8`) instead of one
address, so that one config binds every internal server of every node to that node's own address on the
cluster network, never to every interface (`0.0.0.0`, which also listens on public ones).

```python
resolve_host("10.1.0.0/16")   # "10.1.4.7" on a node with an interface in 10.1.0.0/16
resolve_host("127.0.0.1")     # unchanged: an address, a host name or 0.0.0.0
```
"""

from __future__ import annotations

import ipaddress
import socket


def is_network(host: str) -> bool:
    """Whether `host` names a network (`ADDRESS/PREFIX`) rather than one address or name."""
    if "/" not in host:
        return False
    try:
        ipaddress.ip_network(host, strict=False)
    except ValueError:
        return False
    return True


def local_addresses() -> list[str]:
    """Every IPv4 / IPv6 address of this machine's interfaces (psutil), loopback included."""
    import psutil

    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.append(a.address.split("%", 1)[0])  # an IPv6 link-local address's zone
    return out


def resolve_host(host: str, addresses: list[str] | None = None) -> str:
    """The address a server of this node binds for `host`: for a network, this node's (first) interface
    address in it, else `host` unchanged. `addresses`: the candidates (default: `local_addresses()`).
    RuntimeError, naming the network and this node's addresses, when no interface is in it."""
    if not is_network(host):
        return host
    network = ipaddress.ip_network(host, strict=False)
    candidates = local_addresses() if addresses is None else addresses
    for address in candidates:
        try:
            if ipaddress.ip_address(address) in network:
                return address
        except ValueError:
            continue
    raise RuntimeError(f"host {host}: no interface of this node ({socket.gethostname()}) has an address in that "
                       f"network (its addresses: {', '.join(candidates) or 'none'}); set `host:` to the cluster "
                       "network these nodes share")


def is_loopback_host(host: str) -> bool:
    """Whether `host` (an address, a network or `localhost`) is on loopback only."""
    try:
        if is_network(host):
            return ipaddress.ip_network(host, strict=False).is_loopback
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
