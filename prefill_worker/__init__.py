"""prefill_worker: the prefill-only engine instance (a small EP group) that prefills, samples the first
token and pushes compressed KV to the decode instance. Filled by the disaggregated-serving issue."""
