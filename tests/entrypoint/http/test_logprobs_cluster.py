"""Issue 31: logprobs through the disaggregated path (prefill samples and scores the first token, decode the
rest; entrypoint and HTTP front carry them) equal the offline engine's on the built-in model: same tokens,
logprobs and top alternatives within 1e-5. Runs on the live local cluster of this folder (conftest.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoint.http.conftest import API_KEY

TOL = 1e-5
PROMPT = [7, 21, 99, 100, 5, 42, 300, 12, 77, 8, 9, 250]


@pytest.fixture(scope="module")
def offline(default_model_dir):
    from deepinfer.engine import LLM, SamplingParams

    llm = LLM(str(default_model_dir))
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                       logprobs=3), use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.logprobs


def test_generate_logprobs_equal_the_offline_engine(cluster, offline):
    ref_ids, ref_lps = offline
    with httpx.Client(base_url=cluster.http_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True,
                                                         "logprobs": 3}}
        answers = [http.post("/v1/generate", json=body).json()]
        streamed = http.post("/v1/generate", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        answers.append({"choices": [{"token_ids": [t for c in chunks for t in c["choices"][0]["token_ids"]],
                                     "logprobs": [lp for c in chunks for lp in c["choices"][0].get("logprobs", [])]}]})
    for answer in answers:
        choice = answer["choices"][0]
        assert choice["token_ids"] == ref_ids
        assert [lp["token_id"] for lp in choice["logprobs"]] == ref_ids  # the first (prefill's) token included
        for got, ref in zip(choice["logprobs"], ref_lps):
            assert abs(got["logprob"] - ref.logprob) <= TOL and got["rank"] == ref.rank
            assert [t["token_id"] for t in got["top_logprobs"]] == ref.top_token_ids
            assert all(abs(t["logprob"] - v) <= TOL for t, v in zip(got["top_logprobs"], ref.top_logprobs))


def test_completions_logprobs_cover_every_token(cluster, offline):
    ref_ids, ref_lps = offline
    with httpx.Client(base_url=cluster.http_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "logprobs": 2, "min_tokens": 6})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == r.json()["usage"]["completion_tokens"] == len(ref_ids)
    assert abs(lp["token_logprobs"][0] - ref_lps[0].logprob) <= TOL  # EOS held back: later tokens may differ


def test_metrics_carry_phase_step_and_transfer_figures(cluster, offline):
    """After the requests above (and any of this session): the entrypoint's phase histograms and the stage
    instances' engine step, preemption and KV-transfer figures are on the front's /metrics."""
    with httpx.Client(base_url=cluster.http_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        http.post("/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
        text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for phase in ("queue", "prefill", "first_decode"):
        assert values[f'deepinfer_entrypoint_phase_seconds_count{{phase="{phase}"}}'] >= 1
    for stage in ("prefill", "decode"):
        steps = [v for k, v in values.items() if k.startswith("deepinfer_stage_engine_steps_total") and stage in k]
        assert steps and steps[0] >= 1
        assert any(k.startswith("deepinfer_stage_num_preemptions_total") and stage in k for k in values)
    assert any(k.startswith("deepinfer_stage_kv_transfer_send_seconds_sum") and v > 0 for k, v in values.items())
    assert values["deepinfer_http_prefix_cache_hit_rate"] >= 0
    # the workers' own histograms (engine.latency) and figures, through Health and the balancers
    for stage, phase in (("prefill", "queue"), ("prefill", "prefill"), ("prefill", "kv_transfer"), ("decode", "step")):
        assert any(k.startswith("deepinfer_stage_latency_seconds_count") and f'phase="{phase}"' in k
                   and f'stage="{stage}"' in k and v >= 1 for k, v in values.items()), (stage, phase)
    assert any(k.startswith("deepinfer_stage_prefix_cache_hit_rate") for k in values)
