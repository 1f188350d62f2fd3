"""The request's traffic class: the API key's, else X-Sluice-Traffic-Class, else chat (fake engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.auth import KeyChecker
from services.api.config import ApiConfig, load_key_file
from services.api.engine_client import EngineOutput, EngineRequest, EngineStats, ModelInfo
from services.api.traffic_class import ApiKey, parse_api_keys, parse_key_entry, resolve_traffic_class


class RecordingEngine:
    """An ``EngineClient`` that records each request and answers one token, then stop."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.requests: list[EngineRequest] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        n = len(request.prompt_token_ids)
        yield EngineOutput(request.request_id, (100,), None, "stop", n, 0, 1)

    async def abort(self, request_id: str) -> None:
        pass

    async def ready(self, timeout_s: float = 5.0) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0, 0, 0, 0)

    def model_info(self) -> ModelInfo:
        return self.info


@pytest.fixture(scope="module")
def model_info(tmp_path_factory) -> ModelInfo:
    from engine.checkpoint.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, 1024)
    return ModelInfo("tiny", 8192, 1024, (1,), str(out / "tokenizer.json"))


KEYS = ("sk-agent:agent", "sk-plain", "sk-chat:chat")


@pytest.fixture()
def served(model_info):
    """(TestClient, RecordingEngine) of an app with keys: one agent, one without class, one chat."""
    engine = RecordingEngine(model_info)
    app = create_app(ApiConfig(api_keys=KEYS, default_max_tokens=4), engine)
    with TestClient(app) as client:
        yield client, engine


@pytest.fixture()
def open_server(model_info):
    engine = RecordingEngine(model_info)
    with TestClient(create_app(ApiConfig(default_max_tokens=4), engine)) as client:
        yield client, engine


CHAT = ("/v1/chat/completions", {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]})
COMPLETION = ("/v1/completions", {"model": "tiny", "prompt": "hello"})
MESSAGES = (
    "/v1/messages",
    {"model": "deepseek-chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
)


def post(client, endpoint, headers=None):
    path, body = endpoint
    return client.post(path, json=body, headers=headers or {})


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION, MESSAGES], ids=["chat", "completions", "messages"])
def test_default_is_chat_and_the_header_selects_agent(open_server, endpoint):
    client, engine = open_server
    assert post(client, endpoint).status_code == 200
    assert post(client, endpoint, {"X-Sluice-Traffic-Class": "agent"}).status_code == 200
    assert post(client, endpoint, {"x-sluice-traffic-class": " Chat "}).status_code == 200
    assert [r.traffic_class for r in engine.requests] == ["chat", "agent", "chat"]


@pytest.mark.parametrize("endpoint", [CHAT, MESSAGES], ids=["openai", "anthropic"])
def test_a_header_outside_the_set_is_a_400_naming_header_and_values(open_server, endpoint):
    client, engine = open_server
    r = post(client, endpoint, {"X-Sluice-Traffic-Class": "batch"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "X-Sluice-Traffic-Class" in message and "agent, chat" in message and "'batch'" in message
    assert engine.requests == []


def test_the_key_class_beats_the_header(served):
    client, engine = served
    cases = [
        ("sk-agent", None, "agent"),
        ("sk-agent", "chat", "agent"),  # the header cannot give an agent key's blocks chat's TTL
        ("sk-chat", "agent", "chat"),  # nor a chat key's blocks agent's
        ("sk-plain", "agent", "agent"),  # a key without class: the header decides
        ("sk-plain", None, "chat"),
    ]
    for key, header, _ in cases:
        headers = {"Authorization": f"Bearer {key}"}
        if header is not None:
            headers["X-Sluice-Traffic-Class"] = header
        assert post(client, CHAT, headers).status_code == 200
    assert post(client, MESSAGES, {"x-api-key": "sk-agent"}).status_code == 200
    assert [r.traffic_class for r in engine.requests] == [c[2] for c in cases] + ["agent"]
    # the class suffix is configuration, not part of the key
    assert post(client, CHAT, {"Authorization": "Bearer sk-agent:agent"}).status_code == 401
    # a bad header is refused even with a classed key
    r = post(client, CHAT, {"Authorization": "Bearer sk-agent", "X-Sluice-Traffic-Class": "gold"})
    assert r.status_code == 400 and "X-Sluice-Traffic-Class" in r.json()["error"]["message"]


def test_engine_request_validates_its_class():
    assert EngineRequest("r", (1, 2), 4).traffic_class == "chat"
    assert EngineRequest("r", (1, 2), 4, traffic_class="agent").traffic_class == "agent"
    with pytest.raises(ValueError, match="traffic_class must be one of agent, chat"):
        EngineRequest("r", (1, 2), 4, traffic_class="bulk")


def test_key_entries_parse_and_validate(tmp_path):
    assert parse_key_entry("sk-1") == ApiKey("sk-1", None)
    assert parse_key_entry(" sk-1 : agent ") == ApiKey("sk-1", "agent")
    assert parse_key_entry("a:b:chat") == ApiKey("a:b", "chat")  # a key holding ':' names its class
    assert "sk-1" not in repr(parse_key_entry("sk-1:agent"))
    for bad, match in (("sk-1:gold", "one of agent, chat"), (":agent", "must not be empty"), ("a:b", "':b'")):
        with pytest.raises(ValueError, match=match):
            parse_key_entry(bad)
    with pytest.raises(ValueError, match="twice with different traffic classes"):
        parse_api_keys(["k:agent", "k"])
    assert parse_api_keys(["k:agent", "k:agent"]) == (ApiKey("k", "agent"),)
    with pytest.raises(ValueError, match="ApiConfig.api_keys: .*one of agent, chat"):
        ApiConfig(api_keys=("k:premium",))
    keys = tmp_path / "keys"
    keys.write_text("# agents\nsk-bot:agent\nsk-human\n")
    cfg = ApiConfig(api_keys_file=keys).resolve("tiny", 8192)
    assert load_key_file(keys) == ("sk-bot:agent", "sk-human") == cfg.api_keys
    checker = KeyChecker(cfg.api_keys)
    assert checker.check("/v1/models", {"x-api-key": "sk-bot"}) == "agent"
    assert checker.check("/v1/models", {"authorization": "Bearer sk-human"}) is None
    assert checker.check("/health", {}) is None


def test_resolve_order():
    assert resolve_traffic_class(None, None) == "chat"
    assert resolve_traffic_class("AGENT", None) == "agent"
    assert resolve_traffic_class("agent", "chat") == "chat"
    assert resolve_traffic_class(None, "agent") == "agent"
