"""`deepinfer up --tls-cert --tls-key --tls-ca` end to end (issue 31): a local Ray cluster of the built-in model
whose every gRPC service serves TLS and whose HTTP front serves https; `up` reports success only after its
health checks passed over TLS, the state file records the TLS files, `generate --prompt` on the recorded
cluster dials TLS, a plaintext client is refused, and Ctrl-C takes it all down."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.request

import grpc
import pytest

from deepinfer.protos import common_pb2, entrypoint_pb2_grpc
from deepinfer.serving.auth import SECRET_ENV, SECRET_FILE_ENV, TLS_ENVS
from tests.serving.test_tls import pki  # noqa: F401  (fixture: a test CA and a certificate for 127.0.0.1)


def test_up_with_tls_serves_every_endpoint_over_tls(pki, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k not in (*TLS_ENVS, SECRET_ENV, SECRET_FILE_ENV)}
    env.update(DEEPINFER_HOME=str(tmp_path), DEEPINFER_CLUSTER="", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "deepinfer.deploy.cli"]
    up = subprocess.Popen([*cmd, "up", "--name", "tls-test", "--port", "0", "--tls-cert", pki["cert"], "--tls-key",
                           pki["key"], "--tls-ca", pki["ca"]], env=env, stdout=subprocess.PIPE,
                          stderr=open(tmp_path / "up.err", "w"), text=True)
    try:
        line = up.stdout.readline()  # the addresses, once every service answered its health check (over TLS)
        assert line.startswith("{"), (tmp_path / "up.err").read_text()[-3000:]
        state = json.loads(line)
        assert state["http"].startswith("https://127.0.0.1:")
        recorded = json.loads((tmp_path / "clusters" / "tls-test.json").read_text())
        assert recorded["tls"]["DEEPINFER_TLS_CA"] == pki["ca"]

        context = ssl.create_default_context(cafile=pki["ca"])
        with urllib.request.urlopen(state["http"] + "/health", timeout=30, context=context) as r:
            assert r.status == 200
        with grpc.insecure_channel(state["entrypoint"]) as plain:
            with pytest.raises(grpc.RpcError) as info:
                entrypoint_pb2_grpc.EntrypointStub(plain).Health(common_pb2.HealthRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        r = subprocess.run([*cmd, "generate", "--name", "tls-test", "--prompt", "Hello", "--max-tokens", "3",
                            "--temperature", "0"], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert 1 <= len(json.loads(r.stdout.splitlines()[0])["token_ids"]) <= 3  # EOS may come first
        assert f"generated on the entrypoint {state['entrypoint']}" in r.stderr  # not offline
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    assert up.returncode in (0, 130)
    assert not (tmp_path / "clusters" / "tls-test.json").exists()
