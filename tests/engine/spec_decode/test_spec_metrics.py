"""Speculative decoding's figures as a decode worker's Health stats carry them, and as the HTTP front's
Prometheus export reads them (`deepinfer_stage_spec_decode_*{stage, instance}`)."""

from __future__ import annotations

from prometheus_client import generate_latest

from deepinfer.engine.spec_decode import SpecDecodeMetrics
from deepinfer.entrypoint.http.metrics import HttpMetrics


def test_health_stats_and_prometheus_export():
    m = SpecDecodeMetrics(3)
    m.num_steps = 2
    m.record(3, 2)  # 4 verified tokens, 3 emitted
    m.record(3, 0)  # 4 verified tokens, 1 emitted
    s = m.health_stats()
    assert s["spec_decode_num_draft_tokens"] == 3
    assert s["spec_decode_verified_tokens_total"] == 8 and s["spec_decode_emitted_tokens_total"] == 4
    assert s["spec_decode_accepted_drafts_total"] == 2 and s["spec_decode_verified_drafts_total"] == 6
    assert s["spec_decode_acceptance_rate"] == 2 / 6
    assert s["spec_decode_mean_accepted_length"] == 2.0
    assert s["spec_decode_verified_tokens_per_step"] == 4.0
    assert s["spec_decode_acceptance_rate_per_position"] == [0.5, 0.5, 0.0]

    metrics = HttpMetrics()
    metrics.set_stages({("decode", "decode-0"): s})
    text = generate_latest(metrics.registry).decode()
    for name, value in (("acceptance_rate", 2 / 6), ("mean_accepted_length", 2.0), ("verified_tokens_per_step", 4.0),
                        ("accepted_drafts_total", 2.0)):
        line = f'deepinfer_stage_spec_decode_{name}{{instance="decode-0",stage="decode"}}'
        assert line in text, name
        assert abs(float(text.split(line)[1].split()[0]) - value) < 1e-9
