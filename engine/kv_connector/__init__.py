"""KV connectors: where KV comes from and goes to besides the local pools.

`base.py` is the contract (its module docstring is the spec): `KVConnector`, the load / save specs
and the events a poll returns. `holds.py` is the engine-side bookkeeping of blocks a connector
still uses. Implementations live with their transport, outside `engine/`: prefill -> decode
transfer is `kv_transfer.PDConnector` (NIXL); the persistent KV store tier goes beside it, as a
second `KVConnector`, handed to `Engine.set_kv_connector` the same way.
"""

from deepinfer.engine.kv_connector.base import KVConnector, KVConnectorEvents, KVLoadSpec, KVSaveSpec
from deepinfer.engine.kv_connector.holds import KVHold, KVHolds

__all__ = ["KVConnector", "KVConnectorEvents", "KVHold", "KVHolds", "KVLoadSpec", "KVSaveSpec"]
