"""Image intake on the hostile corpus: each case refused with its 4xx and message in < 1 s,
bombs and broken files before any decoder runs; good images resolved by recipe with their
V4.1 token counts, in placeholder order; remote URLs through the allow-list filter."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import deepseek_recipe as dr
import pytest

from services.api import images
from services.api.config import ApiConfig
from services.api.convert import Converter
from services.api.errors import ApiError
from services.api.images import ImageLimits, check_image_ref, resolve_images
from tests.data.hostile_images import accepted, corpus, data_url, gif, jpeg, png

pytestmark = pytest.mark.timing  # wall-clock bounds: `make test` runs these alone

OFF = ImageLimits(
    max_images=8, max_image_bytes=4 * 2**20, max_image_pixels=16 * 2**20, max_image_side_px=8192,
    allow_remote_images=False, allow_hosts=(),
)  # fmt: skip
ON = replace(OFF, allow_remote_images=True, allow_hosts=("localhost",))
WHERE = "messages.0.content[1]"
CASES = corpus()


def source(url: str, detail: str = "high") -> dr.ImageSource:
    if url.startswith("data:"):
        return dr.DataUrlImageSource(url, detail, path=WHERE)  # type: ignore[arg-type]
    return dr.UrlImageSource(url, detail, path=WHERE)  # type: ignore[arg-type]


def test_the_corpus_covers_the_required_cases():
    names = [c.name for c in CASES]
    assert len(CASES) >= 30 and len(set(names)) == len(names)
    required = [
        "truncated PNG", "truncated JPEG", "decompression bomb", "1 x 100,000", "wrong content type",
        "SVG", "animated GIF", "zero bytes", "URL while remote URLs are off",
        "private-address URL while remote URLs are on",
    ]  # fmt: skip
    for fragment in required:
        assert any(fragment in n for n in names), fragment
    assert any("CMYK" in n for n, _ in accepted())  # CMYK JPEG: decided accepted


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_hostile_case_is_refused_with_its_status_and_message(case):
    limits = ON if case.remote_on else OFF
    t0 = time.monotonic()
    with pytest.raises(ApiError) as exc:
        resolve_images([source(case.url)], limits)
    elapsed = time.monotonic() - t0
    assert exc.value.status == case.status, exc.value.message
    assert case.expect in exc.value.message, exc.value.message
    assert WHERE in exc.value.message  # the user can tell which image
    assert elapsed < 1.0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_pre_admission_check_refuses_all_but_decoder_cases(case):
    """``limits.check_body`` runs this before admission: no decoding, no slot taken."""
    limits = ON if case.remote_on else OFF
    if case.at_decode:
        assert check_image_ref(case.url, limits, "x") is not None
        return
    with pytest.raises(ApiError) as exc:
        check_image_ref(case.url, limits, "messages[0].content[1]")
    assert exc.value.status == case.status and case.expect in exc.value.message


def test_refusals_happen_before_any_decoding(monkeypatch):
    """A resolver that fails the test if called: only decoder cases may reach it."""

    class Tripwire:
        def resolve(self, sources, quota):
            raise AssertionError("the decoder was reached")

    monkeypatch.setattr(images, "_components", lambda limits: (None, Tripwire()))
    for case in CASES:
        if case.at_decode:
            continue
        with pytest.raises(ApiError):
            resolve_images([source(case.url)], ON if case.remote_on else OFF)


@pytest.mark.parametrize("name,url", accepted(), ids=[n for n, _ in accepted()])
def test_good_images_resolve_with_their_token_counts(name, url):
    intake = resolve_images([source(url)], OFF)
    (image,) = intake.images
    info = intake.data.images[0]
    assert (image.width, image.height) == (info.width, info.height)
    assert image.tokens == dr.MultiModalData([info]).image_token_adjustment() + 1 > 1
    assert intake.extra_tokens == intake.data.image_token_adjustment()
    assert image.detail == "high" and image.path == WHERE


def test_detail_selects_recipe_preprocessing():
    url = data_url(png(2000, 1000))
    counts = {d: resolve_images([source(url, d)], OFF).images[0].tokens for d in ("low", "high", "auto")}
    assert counts["low"] < counts["high"] == counts["auto"]
    intake = resolve_images([source(url, "low"), source(url, "original")], OFF)
    assert [im.detail for im in intake.images] == ["low", "original"]


def test_a_cached_image_skips_preprocessing_and_resolves_the_same(monkeypatch):
    from services.api import images

    cache = images.PreprocessCache(1 << 20)
    a, b = data_url(png(300, 200)), data_url(png(64, 48))
    first = resolve_images([source(a), source(b, "low")], OFF, cache)
    calls: list[int] = []
    real = images._preprocess
    monkeypatch.setattr(images, "_preprocess", lambda todo, lim: calls.append(len(todo)) or real(todo, lim))
    again = resolve_images([source(b, "low"), source(a)], OFF, cache)  # both held: no recipe call
    assert calls == [] and (cache.hits, cache.misses) == (2, 2)
    assert again.images == first.images[::-1]
    assert [i.data for i in again.data.images] == [i.data for i in first.data.images][::-1]
    assert again.data.image_token_adjustment() == first.data.image_token_adjustment()
    resolve_images([source(a, "low")], OFF, cache)  # another detail is another entry
    assert calls == [1]
    tiny = images.PreprocessCache(10)  # an entry larger than the budget is not kept
    resolve_images([source(a)], OFF, tiny)
    resolve_images([source(a)], OFF, tiny)
    assert tiny.hits == 0


def test_a_cached_data_url_is_neither_decoded_nor_prechecked_again(monkeypatch):
    """The key of a data URL is its base64 text: a hit skips the base64 decode and the header
    pre-check; any other text (here the same file with its last bytes cut) is a miss and is
    checked and refused as before."""
    import base64 as b64

    from services.api import images
    from services.api.image_headers import ImageHeader

    cache = images.PreprocessCache(1 << 20)
    raw = png(300, 200)
    url = data_url(raw)
    first = resolve_images([source(url)], OFF, cache)
    seen: list[str] = []
    for name in ("_decode_data_url", "inspect_image"):
        real = getattr(images, name)
        monkeypatch.setattr(images, name, lambda *a, _r=real, _n=name: seen.append(_n) or _r(*a))
    assert resolve_images([source(url)], OFF, cache).images == first.images
    assert seen == [] and cache.hits == 1
    assert images.check_image_ref(url, OFF, "image[0]", cache) == ImageHeader("png", 300, 200)  # admission
    assert seen == []
    cut = "data:image/png;base64," + b64.b64encode(raw[:-40]).decode()
    for check in (
        lambda: images.check_image_ref(cut, OFF, "image[0]", cache),
        lambda: resolve_images([source(cut)], OFF, cache),
    ):
        with pytest.raises(ApiError):
            check()
        assert seen == ["_decode_data_url", "inspect_image"]  # checked, and refused
        seen.clear()
    fresh = data_url(png(30, 20))  # a new image: admission and preprocessing decode it once
    images.check_image_ref(fresh, OFF, "image[0]", cache)
    resolve_images([source(fresh)], OFF, cache)
    assert seen == ["_decode_data_url", "inspect_image", "_decode_data_url"]


def test_count_limit_applies_to_the_sources():
    with pytest.raises(ApiError) as exc:
        resolve_images([source(data_url(png(2, 2)))] * 3, replace(OFF, max_images=2))
    assert exc.value.param == "max_images"


def test_converter_resolves_in_placeholder_order():
    """Two messages, three images of different shapes: the intake follows the prompt."""
    conv_obj = Converter.__new__(Converter)
    conv_obj.cfg = ApiConfig()
    conv_obj.encoding = dr.DeepseekV41Encoding()
    conv_obj.image_cache = None
    wide, tall, square = (
        data_url(jpeg(400, 100, 3), "image/jpeg"),
        data_url(png(100, 400)),
        data_url(gif(8, 8), "image/gif"),
    )

    def part(url: str, detail: str = "high") -> dict:
        return {"type": "image_url", "image_url": {"url": url, "detail": detail}}

    body = {"model": "DeepSeek-V4.1-Flash", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, part(wide), part(tall, "low")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [part(square)]},
    ]}  # fmt: skip
    conv = dr.ChatCompletionRequest(json.dumps(body)).convert(dr.ConversionOptions())
    intake = conv_obj.resolve_images(conv)
    assert intake is not None
    assert [(im.source_width, im.source_height, im.detail) for im in intake.images] == [
        (400, 100, "high"), (100, 400, "low"), (8, 8, "high"),
    ]  # fmt: skip
    text_only = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}]}
    assert (
        conv_obj.resolve_images(dr.ChatCompletionRequest(text_only).convert(dr.ConversionOptions())) is None
    )


# -- remote URLs: a loopback server stands in for the public host ------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/good.png")
            self.end_headers()
            return
        body = self.routes.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[int]:
    _Handler.routes = {
        "/good.png": png(32, 32),
        "/bomb.png": png(8000, 8000),
        "/pic.svg": b'<svg xmlns="http://www.w3.org/2000/svg"/>',
        "/huge.png": png(16, 16) + bytes(5 * 2**20),
    }
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


@pytest.fixture
def loopback_is_public(monkeypatch):
    """Treat 127.0.0.1 as public (only the address rule; the allow-list still applies)."""
    real = images.is_public_address
    monkeypatch.setattr(images, "is_public_address", lambda a: a == "127.0.0.1" or real(a))
    images._components.cache_clear()
    yield
    images._components.cache_clear()


def test_loopback_is_refused_for_an_allow_listed_host(image_host):
    with pytest.raises(ApiError) as exc:
        resolve_images([source(f"http://localhost:{image_host}/good.png")], ON)
    assert exc.value.param == "image_url_allow_hosts" and "private, loopback" in exc.value.message


def test_remote_images_are_fetched_then_pre_checked(image_host, loopback_is_public):
    base = f"http://localhost:{image_host}"
    intake = resolve_images([source(f"{base}/good.png")], ON)
    assert intake.images[0].source_width == 32 and intake.images[0].tokens > 1
    for path, fragment in [
        ("/bomb.png", "max_image_pixels"),  # fetched, then refused from its header, not decoded
        ("/pic.svg", "not a PNG"),
        ("/huge.png", "max_image_bytes"),  # the fetcher's byte cap
        ("/missing.png", "error status"),
        ("/redirect", "allow-list"),  # to 127.0.0.1, a host not on the allow-list
    ]:
        t0 = time.monotonic()
        with pytest.raises(ApiError) as exc:
            resolve_images([source(base + path)], ON)
        assert fragment in exc.value.message, (path, exc.value.message)
        assert exc.value.status == 400 and time.monotonic() - t0 < 1.0
    with pytest.raises(ApiError) as exc:  # remote off: never fetched
        resolve_images([source(f"{base}/good.png")], OFF)
    assert exc.value.param == "allow_remote_images"


def test_a_silent_image_host_times_out(loopback_is_public, monkeypatch):
    monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # accepts connections, never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(ApiError) as exc:
            resolve_images([source(f"http://localhost:{listener.getsockname()[1]}/slow.png")], ON)
        assert "took longer than 0.5 s" in exc.value.message and time.monotonic() - t0 < 2.0
    finally:
        listener.close()


def test_lifted_images_render_as_the_originals_and_leave_the_body_alone():
    """Base64 payloads in the three request shapes become short stand-ins for recipe; mapped
    back, recipe's sources resolve to the same images as the body itself gives."""
    import copy

    from services.api.image_lift import lift_images

    a, b = data_url(png(64, 48)), data_url(png(300, 200))
    b64 = b.partition(",")[2]
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "image_url", "image_url": {"url": a, "detail": "low"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "input_image", "image_url": a},
        {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
    ]}]}  # fmt: skip
    before = copy.deepcopy(body)
    lifted = lift_images(body)
    assert body == before and lifted is not None
    parts = lifted.body["messages"][0]["content"]
    assert len(json.dumps(lifted.body)) < 1000  # the megabytes stayed behind
    assert parts[1]["image_url"]["detail"] == "low" and parts[4] == body["messages"][0]["content"][4]
    assert set(lifted.originals.values()) == {a, b}  # a twice, under two stand-ins
    assert lifted.originals[parts[1]["image_url"]["url"]] == a
    assert lifted.originals[f"data:image/png;base64,{parts[2]['source']['data']}"] == b
    assert lifted.originals[parts[3]["image_url"]] == a
    assert lift_images({"messages": [{"role": "user", "content": "no images"}]}) is None
    assert lift_images(body).originals.keys().isdisjoint(lifted.originals)  # a fresh nonce each time
    chat = {"model": "m", "messages": [{"role": "user", "content": body["messages"][0]["content"][:2]}]}
    opts = dr.ConversionOptions().with_model_alias("m", dr.ModelVersion.DeepseekV41Flash)
    enc = dr.DeepseekV41Encoding()

    def sources(req: dict) -> list:
        conv = dr.ChatCompletionRequest(req).convert(opts)
        return list(enc.render_conversation(conv.conversation).image_sources)

    direct = resolve_images(sources(chat), OFF)
    small = lift_images(chat)
    assert small is not None
    via = resolve_images(sources(small.body), OFF, None, small.originals)
    assert via.images == direct.images
    assert [i.data for i in via.data.images] == [i.data for i in direct.data.images]
