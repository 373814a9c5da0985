"""The store's figures leave the process: a worker's Health stats (`KVStore.health_stats`) carry the counters and
the per-class figures, the HTTP front's /metrics exports them per instance (`deepinfer_stage_kvstore_*`, per class
`deepinfer_stage_kvstore_class_*{traffic_class}`), and `deepinfer status` prints them per instance; all of them
move as the store is used. (The live path, a worker's Health read by a cluster, is test_store_cluster.py.)"""

from __future__ import annotations

import json
import os

from prometheus_client.parser import text_string_to_metric_families

from deepinfer.entrypoint.http.metrics import HttpMetrics
from deepinfer.kvstore import KVStore, KVStoreConfig, chain_keys
from deepinfer.kvstore.cli import format_instance_figures


def _samples(metrics: HttpMetrics) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_store_figures_reach_metrics_and_status_and_move(tmp_path):
    now = [1000.0]
    store = KVStore(KVStoreConfig(directories=(str(tmp_path),), class_ttls_s={"agent": 10.0, "chat": 100.0}),
                    clock=lambda: now[0], start_threads=False)
    fp = os.urandom(16)
    agent, chat = chain_keys(fp, list(range(4 * 8)), 8), chain_keys(fp, list(range(100, 100 + 2 * 8)), 8)
    for keys, cls in ((agent, "agent"), (chat, "chat")):
        store.put_async([(k, keys[i - 1] if i else None, bytes(512)) for i, k in enumerate(keys)], cls)
    assert len(store.load_prefix(agent, "agent")) == 4 and store.load_prefix(chain_keys(fp, [9] * 16, 8), "chat") == []
    store.refresh_stored()  # what the sweeper thread does every STATS_REFRESH_S

    st = json.loads(json.dumps(store.health_stats()))  # it travels as JSON (Health trailing metadata)
    assert st["kvstore_loads_total"] == 1 and st["kvstore_hit_blocks_total"] == 4 and st["kvstore_backend"] == "embedded"
    assert st["kvstore_classes"]["agent"] == {"lookup_blocks": 4, "hit_blocks": 4, "hit_rate": 1.0, "loads": 1,
                                              "expirations": 0, "stored_blocks": 4, "stored_bytes": st["kvstore_bytes"]
                                              - st["kvstore_classes"]["chat"]["stored_bytes"]}
    assert st["kvstore_classes"]["chat"]["hit_rate"] == 0.0 and st["kvstore_classes"]["chat"]["stored_blocks"] == 2

    metrics = HttpMetrics()
    metrics.set_stages({("prefill", "prefill-0"): st, ("decode", "decode-0"): {"num_kv_blocks_used": 1}})
    got = _samples(metrics)
    lab = (("instance", "prefill-0"), ("stage", "prefill"))
    assert got[("deepinfer_stage_kvstore_loads_total", lab)] == 1
    assert got[("deepinfer_stage_kvstore_written_bytes_total", lab)] == st["kvstore_written_bytes_total"] > 0
    agent_lab = tuple(sorted((*lab, ("traffic_class", "agent"))))
    chat_lab = tuple(sorted((*lab, ("traffic_class", "chat"))))
    assert got[("deepinfer_stage_kvstore_class_hit_rate", agent_lab)] == 1.0
    assert got[("deepinfer_stage_kvstore_class_stored_blocks", chat_lab)] == 2
    assert not any(k[0].startswith("deepinfer_stage_kvstore") and ("instance", "decode-0") in k[1] for k in got)

    # they move: a chat hit, the agent entries expire (sweeper), capacity pressure evicts
    assert len(store.load_prefix(chat, "chat")) == 2
    now[0] += 50.0
    assert store.sweep() == 4
    store.evict(1)
    store.refresh_stored()
    st2 = store.health_stats()
    metrics.set_stages({("prefill", "prefill-0"): st2})
    got = _samples(metrics)
    assert got[("deepinfer_stage_kvstore_class_hit_rate", chat_lab)] == 0.5  # 2 of 4 looked-up chat blocks
    assert got[("deepinfer_stage_kvstore_class_expirations", agent_lab)] == 4
    assert got[("deepinfer_stage_kvstore_class_stored_blocks", agent_lab)] == 0
    assert got[("deepinfer_stage_kvstore_expirations_total", lab)] == 4
    assert got[("deepinfer_stage_kvstore_evictions_total", lab)] == 1
    assert got[("deepinfer_stage_kvstore_class_stored_blocks", chat_lab)] == 1

    # `deepinfer status`: one line per instance with a store
    text = format_instance_figures([{"stage": "prefill", "instance_id": "prefill-0", "stats": st2},
                                    {"stage": "decode", "instance_id": "decode-0", "stats": {}}])
    assert "prefill prefill-0: agent 100% hit / 1 loads, chat 50% hit / 1 loads" in text
    assert "1 evicted, 4 expired" in text and "decode-0" not in text
    assert format_instance_figures([{"stage": "decode", "instance_id": "d", "stats": {}}]) == ""
    store.close()
