"""Fixtures shared by the Ray integration tests: the tiny checkpoint, a single-engine
reference, a 12-node KV store, and ``wait_until`` for state that engines push."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.core import EngineConfig, EngineCore


@pytest.fixture(scope="module")
def model(checkpoint_factory) -> Path:
    return checkpoint_factory("tiny")


@pytest.fixture(scope="module")
def ref(model) -> Iterator[EngineCore]:
    """One engine in the test process, prefix cache off: what the actors must reproduce."""
    c = EngineCore(EngineConfig(model=str(model), enable_prefix_caching=False))
    yield c
    c.close()


@pytest.fixture(scope="module")
def store() -> Iterator[object]:
    """A 12-node KV store with its Redis directory, on loopback (``.spec_path``)."""
    from kvstore.cluster import LocalClusterConfig
    from services.local.store import LocalStore

    with LocalStore(LocalClusterConfig(nodes=12)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(request, model) -> Iterator[str]:
    """The API over one in-process engine with the test module's ``ENGINE`` settings: what
    the served stack must answer (its base URL)."""
    from services.api.inprocess import InProcessEngineClient

    with served(InProcessEngineClient(model, **request.module.ENGINE)) as url:
        yield url


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0, what: str = "condition") -> None:
    """Poll ``predicate`` (pushed engine state lags the calls by a few ms) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.01)


# How long `served` waits for the API to come up: past RayServingClient's own start bound
# (300 s), so a stack that cannot start fails with its own error, and a slow machine's start
# (122 s for test_serving's eight EP ranks beside a loaded second worker) is not a failure.
STACK_START_S = 330.0


@contextlib.contextmanager
def served(client: object, **config: object) -> Iterator[str]:
    """The API (default limits, or ``ApiConfig`` fields ``config``) over ``client`` on
    127.0.0.1: its base URL, until the block ends."""
    from services.api.app import create_app
    from services.api.config import ApiConfig
    from services.api.server import ServerThread

    app = create_app(ApiConfig(**config), client)  # type: ignore[arg-type]
    srv = ServerThread(app, app.state.sluice.config).start(timeout_s=STACK_START_S)
    try:
        yield srv.url
    finally:
        srv.stop()


def completion_stream(url: str, prompt: str, max_tokens: int):
    """A greedy streamed completion through the ``openai`` SDK, running to ``max_tokens``
    (EOS ignored): the recovery tests' long request."""
    import openai

    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    return oai.completions.create(
        model="deepseek-chat", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def completion_text(url: str, prompt: str, max_tokens: int) -> str:
    return "".join(c.choices[0].text for c in completion_stream(url, prompt, max_tokens) if c.choices)
