"""Real API servers on 127.0.0.1: uvicorn on a thread, the in-process engine on the tiny checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from services.api.config import ApiConfig
from services.api.inprocess import InProcessEngineClient
from services.api.server import ServerThread

API_KEYS = ("sk-sluice-test-one", "sk-sluice-test-two")


@dataclass
class RunningServer:
    url: str
    engine: InProcessEngineClient
    config: ApiConfig  # resolved (model names, context limit)
    api_key: str | None

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def _serve(model_dir, cfg: ApiConfig, **engine_kwargs) -> Iterator[RunningServer]:
    from services.api.app import create_app

    engine = InProcessEngineClient(model_dir, **engine_kwargs)
    app = create_app(cfg, engine)
    resolved = app.state.sluice.config
    with ServerThread(app, resolved) as srv:
        yield RunningServer(srv.url, engine, resolved, resolved.api_keys[0] if resolved.api_keys else None)


@pytest.fixture(scope="session")
def tiny_model(checkpoint_factory):
    return checkpoint_factory("tiny")


@pytest.fixture(scope="session")
def api_server(tiny_model) -> Iterator[RunningServer]:
    """Default limits, API keys on, prefix caching on."""
    yield from _serve(tiny_model, ApiConfig(api_keys=API_KEYS, max_concurrency=4, max_queue=8))


@pytest.fixture(scope="module")
def small_server(tiny_model) -> Iterator[RunningServer]:
    """Two slots, two queue places, no prefix cache (so freed blocks are all free again)."""
    cfg = ApiConfig(max_concurrency=2, max_queue=2, queue_timeout_s=60.0, retry_after_s=2)
    yield from _serve(tiny_model, cfg, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def store():
    """A KV store on loopback: 12 node processes and a redis-server (``LocalStore``)."""
    from services.local.store import LocalStore

    with LocalStore() as st:
        yield st


@pytest.fixture(scope="module")
def cold_url(tiny_model) -> Iterator[str]:
    """The reference: an in-process server with no store and no prefix cache."""
    from services.api.app import create_app

    app = create_app(ApiConfig(), InProcessEngineClient(tiny_model, enable_prefix_caching=False))
    with ServerThread(app, app.state.sluice.config) as srv:
        yield srv.url
