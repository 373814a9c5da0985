"""`deepinfer status` shows each rank of a multi-rank instance (issue 25): its running and waiting requests and
its own KV pool, on a line under the instance."""

from __future__ import annotations

from deepinfer.deploy import cli


def test_status_table_has_a_line_per_rank():
    ranks = [{"rank": 0, "num_running_requests": 2, "num_waiting_requests": 1, "num_kv_blocks_used": 30,
              "num_kv_blocks_total": 64},
             {"rank": 1, "num_running_requests": 0, "num_waiting_requests": 0, "num_kv_blocks_used": 0,
              "num_kv_blocks_total": 64}]
    status = {"addresses": {}, "balance": {"decode": 1.0}, "instances": [
        {"stage": "decode", "instance_id": "decode-0", "datacenter": "", "state": "serving", "is_healthy": True,
         "num_running_requests": 2, "num_waiting_requests": 1, "num_kv_blocks_used": 0, "num_kv_blocks_total": 64,
         "heartbeat_age_ms": 10, "pid": 7, "ranks": ranks}]}
    lines = cli._fmt_status(status).splitlines()
    assert lines[1].split()[:2] == ["decode", "decode-0"]
    assert lines[2].split() == ["rank", "0", "2", "1", "30/64", "47%"]
    assert lines[3].split() == ["rank", "1", "0", "0", "0/64", "0%"]
