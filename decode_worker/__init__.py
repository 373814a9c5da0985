"""decode_worker: the decode-only engine instance (a wide EP group) that reserves cache space, receives
KV and decodes with continuous batching. Filled by the disaggregated-serving issue."""
