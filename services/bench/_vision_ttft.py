"""`sluice bench vision`'s part 2, TTFT with and without an image over HTTP: the prompts
(`_messages`), the spawned ``openai`` SDK client (`_client_worker`) and its parent's end of
the pipe (`_Client`), and `ttft_report`, which serves an embedded API, calibrates the
same-length control (`_calibrate`), runs the repeats (`_measure`) and reports their medians
and ratios (`_summary`). `services.bench.vision`'s module doc says what is timed and how.
"""

from __future__ import annotations

import base64
import json
import logging
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench import progress
from services.bench._vision_images import png, preprocess

if TYPE_CHECKING:
    from engine.vision.stage import VisionStage

TTFT_SIZE = (640, 480)
TEXT = (
    "You are looking at a photograph taken at a river lock. The gates hold back the upper "
    "pool while a narrow boat waits in the chamber; the keeper checks the paddles, the "
    "sluices open, and water pours in until both levels meet. "
) * 3
QUESTION = "What is in the picture? Answer in one word."
FILLER = " river"
KINDS = ("text", "image", "hit", "same_len")  # the requests timed, in a repeat's first order


def _messages(image: bytes | None, filler_words: int = 0) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": TEXT + FILLER * filler_words}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    content.append({"type": "text", "text": QUESTION})
    return [{"role": "user", "content": content}]


def _client_worker(base_url: str, conn: Any) -> None:
    """The TTFT client (a spawned process, as a real client is: its request building and
    JSON encoding do not share the server's interpreter). Each command is a message list as
    JSON bytes; it answers ``{"took": s, "built_s": s, "prompt_tokens": n}`` (or
    ``{"error": ...}``); an empty command stops it. ``took`` runs from the moment the built
    request is handed to the HTTP client (its ``request`` event hook) to the parsed answer;
    ``built_s`` is the SDK's own request building before that (JSON-encoding the body)."""
    import openai

    logging.getLogger("httpx2").setLevel(logging.WARNING)
    sent: list[float] = []
    http = openai.DefaultHttpxClient(
        event_hooks={"request": [lambda _request: sent.append(time.perf_counter())]}
    )
    oai = openai.OpenAI(base_url=base_url, api_key="sk-bench", max_retries=0, timeout=600, http_client=http)
    while cmd := conn.recv_bytes():
        try:
            messages = json.loads(cmd)
            sent.clear()
            t0 = time.perf_counter()
            r = oai.chat.completions.create(
                model="deepseek-chat", messages=messages, max_tokens=1, temperature=0.0
            )
            t1 = time.perf_counter()
            answer: dict[str, Any] = {
                "took": t1 - sent[-1], "built_s": sent[-1] - t0,
                "prompt_tokens": r.usage.prompt_tokens if r.usage else -1,
            }  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
            answer = {"error": repr(exc)}
        conn.send_bytes(json.dumps(answer).encode())


class _Client:
    """The parent's end of ``_client_worker``'s pipe. ``ask`` sends one request and returns
    its TTFT and prompt tokens; ``built`` keeps the client's request building, per call (not
    in the TTFT)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.built: list[float] = []

    def ask(self, messages: list[dict[str, Any]]) -> tuple[float, int]:
        self.conn.send_bytes(json.dumps(messages).encode())
        answer = json.loads(self.conn.recv_bytes())
        if "error" in answer:
            raise RuntimeError(f"vision ttft: the client failed: {answer['error']}")
        self.built.append(float(answer["built_s"]))
        return float(answer["took"]), int(answer["prompt_tokens"])


def ttft_report(model_dir: Path, repeats: int, seed: int) -> dict[str, Any]:
    import multiprocessing

    from engine.vision.stage import VisionStage
    from services.api.app import create_app
    from services.api.config import ApiConfig
    from services.api.inprocess import InProcessEngineClient
    from services.api.server import ServerThread

    engine = InProcessEngineClient(model_dir, enable_prefix_caching=False)
    app = create_app(ApiConfig(), engine)
    alone = VisionStage.from_model_dir(model_dir, cache_bytes=0)  # the encode time alone, same process
    if alone is None:
        raise RuntimeError(f"{model_dir} has no vision encoder")
    ctx = multiprocessing.get_context("spawn")
    with ServerThread(app, app.state.sluice.config) as srv:
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_client_worker, args=(f"{srv.url}/v1", theirs), daemon=True)
        proc.start()
        client = _Client(ours)
        prompt_tokens, words = _calibrate(client, seed)
        times, client_build = _measure(client, alone, repeats, seed, words)
        stats = engine.stats().extra
        ours.send_bytes(b"")
        proc.join(30)
    return _summary(prompt_tokens, repeats, times, client_build, stats)


def _calibrate(client: _Client, seed: int) -> tuple[dict[str, int], int]:
    """Warm-up (every kind once) and the filler calibration for the same-length control:
    each kind's prompt tokens, and the filler words that pad the text to the image's count."""
    warm = png(seed * 100_000 + 99_999, *TTFT_SIZE)
    _, text_tokens = client.ask(_messages(None))
    _, image_tokens = client.ask(_messages(warm))
    client.ask(_messages(warm))
    _, probe = client.ask(_messages(None, 50))
    per_word = (probe - text_tokens) / 50
    words = max(0, round((image_tokens - text_tokens) / per_word))
    for _ in range(3):
        _, same_tokens = client.ask(_messages(None, words))
        if same_tokens == image_tokens:
            break
        words += round((image_tokens - same_tokens) / per_word) or (1 if same_tokens < image_tokens else -1)
    progress(f"vision ttft: text {text_tokens} tokens, image {image_tokens}, same-length text {same_tokens}")
    return {"text": text_tokens, "image": image_tokens, "hit": image_tokens, "same_len": same_tokens}, words


def _measure(
    client: _Client, alone: VisionStage, repeats: int, seed: int, words: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``repeats`` repeats of the four kinds, in alternating order, each with a new image,
    and that image's preprocessing and encode alone: the times, and the client's request
    building per kind."""
    from engine.vision.stage import ImagePart

    times: dict[str, list[float]] = {k: [] for k in (*KINDS, "encode", "preprocess")}
    client_build: dict[str, list[float]] = {k: [] for k in KINDS}
    for rep in range(repeats):
        image = png(seed * 100_000 + 50_000 + rep, *TTFT_SIZE)  # never sent before: encoded
        # image then hit (its first sending encodes it); same_len next to that pair, so each
        # repeat's ratios compare requests sent within about a second of each other
        plan = ("text", "image", "hit", "same_len") if rep % 2 == 0 else ("same_len", "image", "hit", "text")
        for kind in plan:
            msgs = _messages(image if kind in ("image", "hit") else None, words if kind == "same_len" else 0)
            took, _ = client.ask(msgs)
            times[kind].append(took)
            client_build[kind].append(client.built[-1])
        t0 = time.perf_counter()
        n, data, w, h = preprocess(image)
        times["preprocess"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        alone.encode([ImagePart(0, n, data, w, h)])
        times["encode"].append(time.perf_counter() - t0)
        progress(
            f"vision ttft: repeat {rep + 1}/{repeats}: "
            + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items())
        )
    return times, client_build


def _summary(
    prompt_tokens: dict[str, int],
    repeats: int,
    times: dict[str, list[float]],
    client_build: dict[str, list[float]],
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Part 2's results: the medians, every time, the ratios of medians and the paired ratios."""
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "definition": "non-streaming chat completion, max_tokens=1, openai SDK in its own process over "
        "loopback HTTP, from the built request's hand-off to the HTTP client to the parsed answer; prefix "
        "caching off",
        "prompt_tokens": prompt_tokens,
        "image_size": f"{TTFT_SIZE[0]}x{TTFT_SIZE[1]}",
        "repeats": repeats,
        "median_s": med,
        "all_s": times,
        # before each TTFT: the SDK building the request (JSON-encoding a 1.2 MB image takes ms)
        "client_build_median_s": {k: statistics.median(v) for k, v in client_build.items()},
        "image_over_encode_plus_text": med["image"] / (med["encode"] + med["text"]),
        "hit_over_text": med["hit"] / med["text"],
        "hit_over_same_len": med["hit"] / med["same_len"],
        "image_over_encode_preprocess_same_len": med["image"] / (med["encode"] + med["preprocess"] + med["same_len"]),
        # the targets' statistic: the median over repeats of each repeat's own ratio, which a
        # shared machine's slow drift (the same request's TTFT moves by 30 % within a run) cancels from
        "paired": {
            "hit_over_same_len": statistics.median(h / s for h, s in zip(times["hit"], times["same_len"])),
            "image_over_encode_preprocess_same_len": statistics.median(
                i / (e + p + s) for i, e, p, s in zip(times["image"], times["encode"], times["preprocess"], times["same_len"])
            ),
        },
        "server_vision_stats": {k: v for k, v in stats.items() if k.startswith("vision_")},
    }  # fmt: skip
