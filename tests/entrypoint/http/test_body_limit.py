"""An oversized request body gets the 413 (OpenAI error shape) that clients actually read (issue 26):
Python's urllib writes the whole body before reading its answer, so a front that answers and closes
while the body is still arriving hands it a connection reset instead. The front (a real uvicorn on a
loopback port, no cluster: a refused body never reaches the backend) reads the body to its end first.
(The reset comes with `Connection: close`, which urllib always sends: uvicorn then closes the socket
as soon as the answer is out, with the body's unread bytes still in it.)
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.entrypoint.http.app import create_app
from deepinfer.entrypoint.http.config import HttpConfig

LIMIT = 1 << 20
BIG = 64 << 20  # the size of the report
KEY = "key-a"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def front():
    app = create_app(HttpConfig(entrypoint="127.0.0.1:1", model=str(builtin_model_path()), served_model_name="m",
                                api_key=KEY, max_body_bytes=LIMIT, access_log=False))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def _assert_413(status: int, payload: bytes) -> None:
    assert status == 413
    error = json.loads(payload)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]


def _connection(front: str) -> http.client.HTTPConnection:
    host, port = front.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_urllib_reads_the_413(front, path):
    request = urllib.request.Request(front + path, data=b"x" * BIG,
                                     headers={"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    _assert_413(info.value.code, info.value.read())


def test_openai_sdk_reads_the_413(front):
    client = openai.OpenAI(base_url=front + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * BIG}])
    assert info.value.status_code == 413
    assert info.value.body["code"] == "request_too_large"


@pytest.mark.parametrize("keep_alive", [False, True])
def test_chunked_body_without_length_reads_the_413(front, keep_alive):
    """No Content-Length: the route finds the body too large while reading it and drains the rest; a
    keep-alive connection then serves the next request."""
    conn = _connection(front)
    try:
        chunks = (b"x" * (1 << 20) for _ in range(BIG >> 20))
        conn.request("POST", "/v1/chat/completions", body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/json", **AUTH,
                              **({} if keep_alive else {"Connection": "close"})})
        response = conn.getresponse()
        _assert_413(response.status, response.read())
        if keep_alive:
            conn.request("GET", "/version", headers=AUTH)
            assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_refused_key_is_read_too(front):
    """The other refusals before the route (here 401) drain the body the same way."""
    request = urllib.request.Request(front + "/v1/chat/completions", data=b"x" * BIG,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 401
    assert json.loads(info.value.read())["error"]["code"] == "invalid_api_key"


def test_expect_100_continue_gets_the_413_before_sending_the_body(front):
    """A client that waits for `100 Continue` (curl does for large bodies) is not asked for the body:
    it gets the 413 at once."""
    conn = _connection(front)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Length", str(LIMIT * 2))
        conn.putheader("Expect", "100-continue")
        conn.putheader("Authorization", AUTH["Authorization"])
        conn.endheaders()
        response = conn.getresponse()
        _assert_413(response.status, response.read())
    finally:
        conn.close()
