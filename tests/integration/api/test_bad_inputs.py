"""The bad-input corpus: every case gets its documented 4xx within a second, on the real
server, while a well-formed streaming request runs alongside and still succeeds.

The corpus is also the table in docs/api.md; ``test_docs_list_every_case`` keeps the two in
step.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.unit.api.images_fixtures import data_url, png

pytestmark = [pytest.mark.integration, pytest.mark.timing]

MSG = [{"role": "user", "content": "hello json"}]
OK_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields) -> bytes:
    return json.dumps({"model": "deepseek-chat", "messages": MSG, **fields}).encode()


def image_msg(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": "what is this"}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    return [{"role": "user", "content": parts}]


@dataclass
class Case:
    name: str
    status: int
    expect: str  # substring of error.param (OpenAI shape) or of the message
    body: bytes = b""
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    auth: str | None = "default"  # "default": the test key; None: no key; other: that key
    chunked: bool = False


TOKENS_9000 = json.dumps({"model": "deepseek-chat", "prompt": [5] * 9000, "max_tokens": 5}).encode()
NESTED = b'{"model": "deepseek-chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
CORPUS = [
    Case("malformed JSON", 400, "body", b'{"model": "deepseek-chat", "messages": [}'),
    Case("empty body", 400, "body", b""),
    Case("JSON array instead of object", 400, "body", b"[1, 2, 3]"),
    Case("deeply nested JSON", 400, "body", NESTED),
    Case("wrong type: temperature string", 400, "expected f32", chat(temperature="hot")),
    Case("wrong type: messages not a list", 400, "invalid", chat(messages="hello")),
    Case("negative max_tokens", 400, "max_tokens", chat(max_tokens=-5)),
    Case("missing model", 400, "model", json.dumps({"messages": MSG}).encode()),
    Case("unknown model", 400, "supported API model names", chat(model="gpt-4o")),
    Case("empty messages", 400, "Empty input messages", chat(messages=[])),
    Case("empty completions prompt", 400, "prompt", b'{"model": "deepseek-chat", "prompt": ""}', "/v1/completions"),
    Case("prompt over the context limit", 400, "context_limit", TOKENS_9000, "/v1/completions"),
    Case("chat prompt over the context limit", 400, "context_limit",
         chat(messages=[{"role": "user", "content": "weather json report " * 3000}])),
    Case("prompt text over max_prompt_chars", 400, "max_prompt_chars",
         chat(messages=[{"role": "user", "content": "z" * (1 << 20 | 1)}])),
    Case("huge n", 400, "max_n", chat(n=1000)),
    Case("huge max_tokens", 400, "max_tokens_limit", chat(max_tokens=10**9)),
    Case("huge max_output_tokens (responses)", 400, "max_tokens_limit",
         json.dumps({"model": "deepseek-chat", "input": "hi", "max_output_tokens": 10**7}).encode(), "/v1/responses"),
    Case("top_logprobs 21", 400, "max_top_logprobs", chat(logprobs=True, top_logprobs=21)),
    Case("top_logprobs 300", 400, "max_top_logprobs", chat(logprobs=True, top_logprobs=300)),
    Case("completions logprobs 50", 400, "max_top_logprobs",
         b'{"model": "deepseek-chat", "prompt": "hi", "logprobs": 50}', "/v1/completions"),
    Case("too many stop sequences", 400, "max_stop_sequences", chat(stop=["x"] * 17)),
    Case("invalid JSON schema", 400, "schema", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}})),
    Case("invalid regex", 400, "response_format.regex", chat(response_format={"type": "regex", "regex": "[a-z+"})),
    Case("schema over max_schema_bytes", 400, "max_schema_bytes", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["v" * 70_000]}}})),
    Case("json_object without 'json' in the prompt", 400, "json",
         chat(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"})),
    Case("too many tools", 400, "max_tools", chat(tools=[OK_TOOL] * 65)),
    Case("image bomb (60000x60000 PNG)", 400, "max_image_", chat(messages=image_msg(data_url(png(60_000, 60_000))))),
    Case("too many images", 400, "max_images", chat(messages=image_msg(*[data_url(png(2, 2))] * 9))),
    Case("data URL that is not an image", 400, "not a PNG", chat(messages=image_msg("data:image/png;base64,aGVsbG8="))),
    Case("remote image URL (off by default)", 400, "allow_remote_images",
         chat(messages=image_msg("http://169.254.169.254/latest/meta-data"))),
    Case("headers over max_header_bytes", 431, "max_header_bytes", chat(), headers={"x-pad": "a" * 20_000}),
    Case("headers over the parser bound", 431, "max_header_bytes", chat(), headers={"x-pad": "a" * 70_000}),
    Case("body over max_body_bytes (Content-Length)", 413, "max_body_bytes", b"x" * (8 * 2**20 + 1)),
    Case("chunked body over max_body_bytes", 413, "max_body_bytes", b"x" * (8 * 2**20 + 1), chunked=True),
    Case("missing API key", 401, "api_key", chat(), auth=None),
    Case("wrong API key", 401, "api_key", chat(), auth="sk-not-a-key"),
    Case("wrong API key (Anthropic)", 401, "authentication_error",
         b'{"model": "deepseek-chat", "max_tokens": 5, "messages": []}', "/v1/messages", auth="sk-nope"),
    Case("Messages with a string max_tokens", 400, "invalid type",
         json.dumps({"model": "deepseek-chat", "max_tokens": "ten", "messages": MSG}).encode(), "/v1/messages"),
    Case("GET on a POST endpoint", 405, "Method Not Allowed", method="GET"),
    Case("unknown path", 404, "Not Found", path="/v1/nope", method="GET"),
]  # fmt: skip


def send(client: httpx.Client, case: Case, key: str) -> httpx.Response:
    headers = dict(case.headers)
    if case.auth == "default":
        headers["authorization"] = f"Bearer {key}"
    elif case.auth is not None:
        headers["authorization" if not case.path.startswith("/v1/messages") else "x-api-key"] = (
            f"Bearer {case.auth}" if not case.path.startswith("/v1/messages") else case.auth
        )
    if case.method == "GET":
        return client.get(case.path, headers=headers)
    headers["content-type"] = "application/json"
    if case.chunked:
        body = case.body

        def chunks():
            for i in range(0, len(body), 1 << 20):
                yield body[i : i + (1 << 20)]

        return client.post(case.path, content=chunks(), headers=headers)
    return client.post(case.path, content=case.body, headers=headers)


def error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    err = body.get("error", body)
    if isinstance(err, dict):
        return " ".join(str(err.get(k)) for k in ("param", "message", "type", "detail"))
    return json.dumps(body)


def test_corpus_has_at_least_25_cases():
    assert len(CORPUS) >= 25 and len({c.name for c in CORPUS}) == len(CORPUS)


def test_bad_inputs_get_their_4xx_fast_while_a_good_request_succeeds(api_server):
    key = api_server.api_key
    good: dict[str, object] = {}

    def good_request() -> None:
        with httpx.Client(base_url=api_server.url, timeout=120) as c:
            body = {"model": "deepseek-chat", "messages": MSG, "max_tokens": 60, "stream": True, "seed": 1}
            with c.stream(
                "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            ) as r:
                good["status"] = r.status_code
                good["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    worker = threading.Thread(target=good_request)
    worker.start()
    failures = []
    with httpx.Client(base_url=api_server.url, timeout=10) as client:
        for case in CORPUS:
            t0 = time.monotonic()
            resp = send(client, case, key)
            elapsed = time.monotonic() - t0
            text = error_text(resp)
            if resp.status_code != case.status or case.expect not in text or elapsed > 1.0:
                failures.append(f"{case.name}: {resp.status_code} in {elapsed:.2f}s: {text[:160]}")
            if resp.headers.get("connection") == "close":
                client.close()
                client = httpx.Client(base_url=api_server.url, timeout=10)
    worker.join(120)
    assert not failures, "\n".join(failures)
    assert good["status"] == 200 and good["lines"][-1] == "data: [DONE]"
    finals = [json.loads(ln[6:]) for ln in good["lines"][:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert api_server.engine.stats().running == 0


def _raw_exchange(url: str, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` whole over a raw socket, then read to the server's end of the stream
    (bounded by the timeout): the answer's (status line and headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


def test_requests_the_parser_refuses_are_answered_not_reset(api_server):
    """h11 refuses headers past its bound before the app runs. The client still reads a 431
    naming the limit, in its path's error shape, although it sent far more than was read (the
    server drains the rest before it closes, so the kernel sends no reset); any other request
    h11 cannot parse gets a 400 in the same shape; the server keeps serving.
    Raw sockets: every byte is sent before anything is read, as a client that does not watch
    for an early answer does."""
    pad = "a" * 200_000
    for path in ("/v1/chat/completions", "/v1/messages") * 5:
        request = f"POST {path} HTTP/1.1\r\nhost: x\r\nx-pad: {pad}\r\ncontent-length: 2\r\n\r\n{{}}"
        head, body = _raw_exchange(api_server.url, request.encode())
        assert head.startswith(b"HTTP/1.1 431 "), head
        err = json.loads(body)
        if path == "/v1/messages":
            assert err["type"] == "error" and "max_header_bytes" in err["error"]["message"]
        else:
            assert err["error"]["param"] == "max_header_bytes" and err["error"]["code"] == "limit_exceeded"
    # any other request h11 cannot parse: a 400 in the same shape, naming the HTTP framing
    head, body = _raw_exchange(api_server.url, b"NOT AN HTTP REQUEST\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), head
    assert json.loads(body)["error"]["param"] == "http"
    with httpx.Client(base_url=api_server.url, timeout=10) as c:
        assert c.get("/health").status_code == 200


def test_rejections_are_counted_by_reason(api_server):
    key = api_server.api_key
    with httpx.Client(base_url=api_server.url, timeout=10, headers={"authorization": f"Bearer {key}"}) as c:
        assert c.post("/v1/chat/completions", content=chat(n=7)).status_code == 400
        metrics = c.get("/metrics").text
    assert 'sluice_api_rejections_total{reason="max_n"}' in metrics
    # the families are there whichever tests ran before (a histogram's buckets only once observed)
    assert "sluice_engine_free_blocks" in metrics
    assert "# TYPE sluice_api_time_to_first_token_seconds histogram" in metrics


def test_health_is_open_and_ready_probes_the_engine(api_server):
    with httpx.Client(base_url=api_server.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        for path in ("/ready", "/metrics", "/v1/models"):  # every endpoint but health needs the key
            assert c.get(path).status_code == 401, path
        ready = c.get("/ready", headers={"x-api-key": api_server.api_key})
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_docs_list_every_case():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()
    missing = [c.name for c in CORPUS if f"| {c.name} |" not in doc]
    assert not missing, f"docs/api.md's corpus table lacks: {missing}"
