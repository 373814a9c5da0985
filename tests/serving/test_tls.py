"""Optional TLS on the internal gRPC services and the HTTP front (issue 31), with a throwaway CA made by
the `openssl` command line for 127.0.0.1 / localhost:

* in-process: a balancer bound by `serving.auth.add_port` with a certificate serves TLS only; a client
  made by `secure_channel` with the CA is served, a plaintext client and a client trusting another CA
  are refused at the handshake;
* real processes started with the `--tls-*` flags (two balancers, the entrypoint, the HTTP front): the
  entrypoint `Client` and the front's own gRPC client go over TLS, a plaintext client is refused, the
  front answers over https checked against the CA (its printed address says https) and refuses plain
  http;
* a certificate that names one DNS name only is checked against `server_name` when dialled by address;
* the flags and the settings' checks (a certificate without its key, a file that is not PEM).
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.protos import common_pb2, loadbalancer_pb2, loadbalancer_pb2_grpc
from deepinfer.serving.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_ENVS,
    TLS_KEY_ENV,
    secure_channel,
    tls_settings,
)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="needs the `openssl` command line to make a test CA (the `cryptography` "
                                       "package is not installed either)")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.crt",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """{ca, cert, key, other_ca}: a CA, a server certificate it signed for 127.0.0.1 and localhost, and an
    unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "other")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
             "-keyout", "server.key", "-out", "server.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.crt", cwd=d)
    # a certificate that names one DNS name only (a cluster dialled by IP addresses: `server_name`)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
             "/CN=deepinfer.internal", "-keyout", "named.key", "-out", "named.csr", cwd=d)
    (d / "named.ext").write_text("subjectAltName=DNS:deepinfer.internal\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "named.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "named.ext", "-out", "named.crt", cwd=d)
    return {"ca": str(d / "ca.crt"), "cert": str(d / "server.crt"), "key": str(d / "server.key"),
            "other_ca": str(d / "other.crt"), "named_cert": str(d / "named.crt"), "named_key": str(d / "named.key")}


@pytest.fixture
def no_tls_env(monkeypatch):
    """Neither TLS nor a cluster secret from the environment of whoever runs the tests."""
    for env in (*TLS_ENVS, SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.setenv(env, "")  # NOTE: recorded, so what the code under test sets is undone too
        monkeypatch.delenv(env)
    return monkeypatch


def _list(address: str, channel: grpc.Channel) -> grpc.StatusCode | None:
    try:
        loadbalancer_pb2_grpc.LoadBalancerStub(channel).ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                                                      timeout=5)
    except grpc.RpcError as e:
        return e.code()
    return None


def test_tls_balancer_serves_tls_clients_only(pki, no_tls_env):
    from deepinfer.loadbalancer.server import start_server

    no_tls_env.setenv(TLS_CERT_ENV, pki["cert"])
    no_tls_env.setenv(TLS_KEY_ENV, pki["key"])
    no_tls_env.setenv(TLS_CA_ENV, pki["ca"])
    running = start_server("127.0.0.1:0", "decode", "round_robin")
    address = f"127.0.0.1:{running.port}"
    try:
        with secure_channel(address) as channel:  # TLS checked against the CA
            stub = loadbalancer_pb2_grpc.LoadBalancerStub(channel)
            stub.Register(loadbalancer_pb2.RegisterRequest(instance_id="decode-0", address="127.0.0.1:1",
                                                           stage=common_pb2.STAGE_DECODE), timeout=5)
            assert [i.instance_id for i in stub.ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                                              timeout=5).instances] == ["decode-0"]
        with grpc.insecure_channel(address) as plain:
            assert _list(address, plain) == grpc.StatusCode.UNAVAILABLE
        no_tls_env.setenv(TLS_CA_ENV, pki["other_ca"])  # a client that trusts another CA
        with secure_channel(address) as wrong:
            assert _list(address, wrong) == grpc.StatusCode.UNAVAILABLE
    finally:
        running.server.stop(0)


def test_server_name_checks_a_certificate_that_names_no_address(pki, no_tls_env):
    from deepinfer.loadbalancer.server import start_server
    from deepinfer.serving.auth import TLS_SERVER_NAME_ENV

    no_tls_env.setenv(TLS_CERT_ENV, pki["named_cert"])
    no_tls_env.setenv(TLS_KEY_ENV, pki["named_key"])
    no_tls_env.setenv(TLS_CA_ENV, pki["ca"])
    running = start_server("127.0.0.1:0", "decode", "round_robin")
    address = f"127.0.0.1:{running.port}"
    try:
        with secure_channel(address) as channel:  # the certificate does not name 127.0.0.1
            assert _list(address, channel) == grpc.StatusCode.UNAVAILABLE
        no_tls_env.setenv(TLS_SERVER_NAME_ENV, "deepinfer.internal")
        with secure_channel(address) as channel:
            assert _list(address, channel) is None
    finally:
        running.server.stop(0)


def test_tls_settings_checks(pki, no_tls_env, tmp_path):
    assert tls_settings() is None
    no_tls_env.setenv(TLS_CERT_ENV, pki["cert"])
    with pytest.raises(RuntimeError, match="both a certificate and its key"):
        tls_settings()
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    no_tls_env.setenv(TLS_KEY_ENV, str(bad))
    with pytest.raises(RuntimeError, match="not PEM"):
        tls_settings()
    no_tls_env.delenv(TLS_CERT_ENV)
    no_tls_env.delenv(TLS_KEY_ENV)
    no_tls_env.setenv(TLS_CA_ENV, pki["ca"])
    tls = tls_settings()
    assert tls.is_client and not tls.is_server  # a CA alone: a TLS client, no TLS server


def test_tls_flags_set_the_process_settings(pki, no_tls_env):
    from deepinfer.loadbalancer.config import LoadBalancerConfig
    from deepinfer.serving.config_cli import config_from_args, make_parser

    parser = make_parser(LoadBalancerConfig, "lb", "test")
    config = config_from_args(LoadBalancerConfig, parser, ["--stage", "decode", "--policy", "round_robin",
                                                           "--tls-cert", pki["cert"], "--tls-key", pki["key"],
                                                           "--tls-ca", pki["ca"]])
    assert config.stage == "decode"
    assert (os.environ[TLS_CERT_ENV], os.environ[TLS_KEY_ENV], os.environ[TLS_CA_ENV]) == (pki["cert"], pki["key"],
                                                                                          pki["ca"])
    assert tls_settings().is_server
    with pytest.raises(SystemExit):  # a key without a certificate: a usage error, before anything starts
        no_tls_env.delenv(TLS_CERT_ENV)
        no_tls_env.delenv(TLS_KEY_ENV)
        config_from_args(LoadBalancerConfig, parser, ["--stage", "decode", "--policy", "round_robin",
                                                      "--tls-key", pki["key"]])


def test_cluster_config_tls_env(pki):
    from deepinfer.deploy.config import ClusterConfig

    config = ClusterConfig.model_validate({"tls": {"cert_file": pki["cert"], "key_file": pki["key"],
                                                   "ca_file": pki["ca"]}})
    assert config.tls.env() == {TLS_CERT_ENV: pki["cert"], TLS_KEY_ENV: pki["key"], TLS_CA_ENV: pki["ca"]}
    assert ClusterConfig().tls is None
    with pytest.raises(ValueError, match="key_file"):
        ClusterConfig.model_validate({"tls": {"cert_file": pki["cert"]}})


def test_up_takes_tls_flags_and_hands_them_to_every_role(pki, no_tls_env, tmp_path):
    from deepinfer.deploy import cli

    parser = cli.build_parser()
    args = parser.parse_args(["up", "--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]])
    config = cli._config_from_args(args, parser)
    assert (config.tls.cert_file, config.tls.key_file, config.tls.ca_file) == (pki["cert"], pki["key"], pki["ca"])
    role_env = cli._role_secrets(config, "s", is_local=False)["role_env"]
    assert {k: role_env[k] for k in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)} == config.tls.env()


def test_up_with_a_bad_tls_file_fails_before_anything_starts(pki, no_tls_env, tmp_path, capsys):
    from deepinfer.deploy import cli
    from deepinfer.deploy.launcher import list_states

    no_tls_env.setenv("DEEPINFER_HOME", str(tmp_path))
    code = cli.main(["up", "--port", "0", "--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", pki["key"]])
    err = capsys.readouterr().err
    assert code == 2 and "missing.crt" in err and "Traceback" not in err
    assert not list_states()  # nothing recorded: Ray never started


@pytest.fixture(scope="module")
def tls_processes(pki, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k not in (*TLS_ENVS, SECRET_ENV, SECRET_FILE_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    tls = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]]
    procs = ServiceProcesses(tmp_path_factory.mktemp("tls-logs"), env)
    try:
        for stage in ("prefill", "decode"):
            procs.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", "round_robin", *tls])
        info = procs.wait_ready(60)
        lbs = ["--prefill-lb-address", info["prefill_lb"]["address"], "--decode-lb-address",
               info["decode_lb"]["address"]]
        procs.spawn("entrypoint", ["entrypoint", "--model", str(builtin_model_path()), *lbs, *tls])
        info = procs.wait_ready(60)
        procs.spawn("http", ["entrypoint.http", "--entrypoint", info["entrypoint"]["address"], "--port", "0",
                             "--model", str(builtin_model_path()), "--no-access-log", *lbs, *tls])
        yield procs.wait_ready(60)
    finally:
        procs.stop(5)


def test_tls_processes_entrypoint(pki, tls_processes, no_tls_env):
    from deepinfer.entrypoint.client import Client
    from deepinfer.protos import entrypoint_pb2_grpc

    address = tls_processes["entrypoint"]["address"]
    no_tls_env.setenv(TLS_CA_ENV, pki["ca"])
    with Client(address) as client:
        health = client.health()  # answered over TLS; no instance registered yet
        assert health["is_healthy"] is False
    no_tls_env.delenv(TLS_CA_ENV)
    with grpc.insecure_channel(address) as plain:
        with pytest.raises(grpc.RpcError) as info:
            entrypoint_pb2_grpc.EntrypointStub(plain).Health(common_pb2.HealthRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_processes_http_front_serves_https(pki, tls_processes):
    url = tls_processes["http"]["address"]
    assert url.startswith("https://127.0.0.1:")
    context = ssl.create_default_context(cafile=pki["ca"])
    with urllib.request.urlopen(url + "/v1/models", timeout=10, context=context) as r:
        assert r.status == 200 and json.loads(r.read())["data"]
    # /health goes front -> entrypoint -> balancers, every hop TLS: the entrypoint's own answer (no
    # instance yet), not an unreachable entrypoint
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url + "/health", timeout=10, context=context)
    body = json.loads(info.value.read())
    assert info.value.code == 503 and "instance" in body["message"] and "unreachable" not in body["message"], body
    with pytest.raises(urllib.error.URLError):  # the system roots do not know the test CA
        urllib.request.urlopen(url + "/v1/models", timeout=10, context=ssl.create_default_context())
    with pytest.raises((urllib.error.URLError, ConnectionError, http_client_errors())):
        urllib.request.urlopen(url.replace("https://", "http://") + "/v1/models", timeout=10)


def http_client_errors():
    import http.client

    return http.client.HTTPException
