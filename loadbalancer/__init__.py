"""loadbalancer: per-stage balancers (membership, health, routing policies, balance metrics).

The core is pure and in-process (no sockets): `Membership` (registration, heartbeats, expiry),
`policies` (a registry of routing rules), `Balancer` (filter, pick, count). `loadbalancer.server`
is the thin gRPC shell (`deepinfer.v1.LoadBalancer`, protos/loadbalancer.proto) around it.

```python
from deepinfer.loadbalancer import Balancer, InstanceInfo, InstanceLoad, Membership, RequestInfo
members = Membership(heartbeat_timeout_s=3.0)
members.register(InstanceInfo("prefill-0", "prefill", address="10.0.0.5:7000", block_size=64))
balancer = Balancer("prefill", "prefix_aware", members)
instance = balancer.pick(RequestInfo(block_hashes=hashes, num_prompt_tokens=900))
```
"""

from deepinfer.loadbalancer.balancer import Balancer, InsufficientCapacity, NoHealthyInstance, RequestTooLarge
from deepinfer.loadbalancer.membership import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HeartbeatResult,
    Instance,
    InstanceInfo,
    InstanceLoad,
    Membership,
    Stage,
)
from deepinfer.loadbalancer.policies import POLICIES, Policy, RequestInfo, make_policy, register_policy, stage_load

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "POLICIES",
    "Balancer",
    "HeartbeatResult",
    "Instance",
    "InstanceInfo",
    "InstanceLoad",
    "InsufficientCapacity",
    "Membership",
    "NoHealthyInstance",
    "Policy",
    "RequestInfo",
    "RequestTooLarge",
    "Stage",
    "make_policy",
    "register_policy",
    "stage_load",
]
