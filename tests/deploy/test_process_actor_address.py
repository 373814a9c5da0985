"""`ProcessActor` (the HTTP front under `deepinfer up`) takes its address from the JSON line the child prints
(issue 31: with `--port 0` it waited on port 0 and failed, and an HTTPS front was recorded as plain
`host:port`, so `up`'s health check spoke http to it)."""

from __future__ import annotations

from deepinfer.deploy.actors import _printed_address


def test_the_printed_address_is_taken_with_its_scheme_and_port(tmp_path):
    log = tmp_path / "http.log"
    log.write_text('{"address": "http://127.0.0.1:1"}\n')  # an earlier life's line (Ray restarted the actor)
    start = log.stat().st_size
    assert _printed_address(str(log), start) is None
    with open(log, "a") as f:
        f.write("some log line\n{\"address\": broken\n")
    assert _printed_address(str(log), start) is None
    with open(log, "a") as f:
        f.write('{"address": "https://127.0.0.1:44399"}\nINFO serving\n')
    assert _printed_address(str(log), start) == "https://127.0.0.1:44399"
