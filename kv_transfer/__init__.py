"""kv_transfer: moving compressed KV and image embeddings between stages with NIXL (agents, block
descriptors, notifications, leases) and the persistent KV store tier. Filled by the disaggregated-serving issue."""
