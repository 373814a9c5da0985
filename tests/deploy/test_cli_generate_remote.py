"""`deepinfer generate --prompt TEXT` against the recorded cluster (issue 31, first-run friction: it used to
fail): the text is tokenized with the cluster's model as the offline engine does, sent to the recorded
entrypoint, and the answer printed; with a TLS cluster the CLI dials TLS with the recorded CA.

The entrypoint is an in-process fake (Health + Generate) that records what it was sent."""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import pytest

from deepinfer.deploy import cli
from deepinfer.deploy.launcher import write_state
from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.tokenizer import load_tokenizer
from deepinfer.protos import common_pb2, entrypoint_pb2, entrypoint_pb2_grpc
from deepinfer.serving.auth import SECRET_ENV, SECRET_FILE_ENV, TLS_ENVS, add_port
from tests.serving.test_tls import pki  # noqa: F401  (fixture: a test CA and a certificate for 127.0.0.1)


class _FakeEntrypoint(entrypoint_pb2_grpc.EntrypointServicer):
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def Health(self, request, context):
        return common_pb2.HealthResponse(is_healthy=True)

    def Generate(self, request, context):
        self.prompts.append(list(request.prompt_token_ids))
        yield entrypoint_pb2.GenerateResponse(request_id=request.request_id, token_ids=[11, 12],
                                              finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                              usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                                     completion_tokens=2))


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path))
    monkeypatch.delenv("DEEPINFER_CLUSTER", raising=False)
    for name in (*TLS_ENVS, SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.setenv(name, "")  # recorded, so what the CLI sets (`_use_tls`) is undone after the test
        monkeypatch.delenv(name)
    return monkeypatch


def _serve(fake) -> tuple[grpc.Server, str]:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    entrypoint_pb2_grpc.add_EntrypointServicer_to_server(fake, server)
    port = add_port(server, "127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _generate(capsys, *args: str):
    code = cli.main(["generate", "--prompt", "Hello, DeepSeek-V4!", "--max-tokens", "2", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _expected_ids() -> list[int]:
    return load_tokenizer(builtin_model_path()).encode("Hello, DeepSeek-V4!", add_special_tokens=False).ids


def test_generate_prompt_text_on_the_recorded_cluster(env, capsys):
    fake = _FakeEntrypoint()
    server, address = _serve(fake)
    try:
        write_state({"name": "deepinfer", "status": "up", "pid": None, "is_detached": True, "entrypoint": address,
                     "model": str(builtin_model_path())})
        code, out, err = _generate(capsys)
    finally:
        server.stop(0)
    assert code == 0, err
    assert fake.prompts == [_expected_ids()]
    assert json.loads(out.splitlines()[0])["token_ids"] == [11, 12]
    assert f"generated on the entrypoint {address}" in err


def test_generate_dials_a_tls_cluster_with_its_recorded_ca(env, capsys, pki):  # noqa: F811
    from deepinfer.serving.auth import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV

    tls = {TLS_CERT_ENV: pki["cert"], TLS_KEY_ENV: pki["key"], TLS_CA_ENV: pki["ca"]}
    for name, value in tls.items():
        env.setenv(name, value)
    fake = _FakeEntrypoint()
    server, address = _serve(fake)  # serves TLS only
    for name in tls:
        env.delenv(name)  # the CLI process starts without them: it takes them from the record
    try:
        write_state({"name": "deepinfer", "status": "up", "pid": None, "is_detached": True, "entrypoint": address,
                     "model": str(builtin_model_path()), "tls": tls})
        code, out, err = _generate(capsys)
    finally:
        server.stop(0)
    assert code == 0, err
    assert fake.prompts == [_expected_ids()]
