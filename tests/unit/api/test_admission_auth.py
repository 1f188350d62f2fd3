import asyncio

import pytest

from services.api.admission import AdmissionController
from services.api.auth import KeyChecker
from services.api.errors import ApiError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_admission_bounds_running_and_queued_and_refuses_fast():
    async def scenario():
        adm = AdmissionController(max_concurrency=2, max_queue=1, queue_timeout_s=5, retry_after_s=3)
        release = asyncio.Event()
        order = []

        async def worker(i):
            async with adm.slot():
                order.append(i)
                await release.wait()

        tasks = [asyncio.create_task(worker(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert adm.stats.running == 2 and adm.stats.queued == 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ApiError) as exc:
            await adm.acquire()
        assert loop.time() - t0 < 0.05  # refused without waiting
        assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "3"
        release.set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]  # FIFO: the queued one ran after a slot freed
        assert adm.stats.running == 0 and adm.stats.queued == 0
        assert adm.stats.rejected_full == 1 and adm.stats.admitted_total == 3

    run(scenario())


def test_queued_request_times_out_with_429_and_leaks_no_slot():
    async def scenario():
        adm = AdmissionController(max_concurrency=1, max_queue=4, queue_timeout_s=0.1, retry_after_s=1)
        await adm.acquire()
        with pytest.raises(ApiError) as exc:
            await adm.acquire()
        assert exc.value.status == 429 and exc.value.param == "queue_timeout_s"
        adm.release()
        assert adm.stats.running == 0
        await adm.acquire()  # the slot is usable again
        adm.release()

    run(scenario())


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        adm = AdmissionController(max_concurrency=1, max_queue=4, queue_timeout_s=5, retry_after_s=1)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0.01)
        assert adm.stats.queued == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.stats.queued == 0
        adm.release()
        assert adm.stats.running == 0

    run(scenario())


def test_keys_accept_either_header_and_compare_every_key():
    keys = KeyChecker(["alpha-key", "beta-key"])
    keys.check("/v1/models", {"authorization": "Bearer beta-key"})
    keys.check("/v1/messages", {"x-api-key": "alpha-key"})
    keys.check("/health", {})  # health is open
    for headers, code in (({}, "missing_api_key"), ({"authorization": "Bearer alpha"}, "invalid_api_key"),
                          ({"authorization": "Basic alpha-key"}, "missing_api_key"),
                          ({"x-api-key": "alpha-key-"}, "invalid_api_key")):  # fmt: skip
        with pytest.raises(ApiError) as exc:
            keys.check("/v1/chat/completions", headers)
        assert exc.value.status == 401 and exc.value.code == code
    assert not KeyChecker([]).enabled
    KeyChecker([]).check("/v1/models", {})


def test_key_compare_has_no_early_exit(monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(b) or real(a, b))
    KeyChecker(["k1", "k2", "k3"]).matches("k1")
    assert calls == [b"k1", b"k2", b"k3"]  # matched the first key, still compared all three


def test_serve_flags_beat_the_cluster_file_and_env(tmp_path, monkeypatch):
    from services.cli import build_parser
    from services.commands.serve import api_config_from

    spec = tmp_path / "cluster.yaml"
    spec.write_text(
        "mode: embedded\napi:\n  host: 127.0.0.1\n  port: 9100\n  max_concurrency: 3\n  max_queue: 5\n"
    )
    monkeypatch.setenv("SLUICE_PORT", "9000")
    monkeypatch.setenv("SLUICE_API_KEYS", "k1,k2")
    argv = [
        "serve",
        "--config",
        str(spec),
        "--max-queue",
        "7",
        "--model",
        str(tmp_path),
        "--allow-image-host",
        "img.example",
    ]
    cfg, host, port, model = api_config_from(build_parser().parse_args(argv))
    assert (host, port, model) == ("127.0.0.1", 9100, tmp_path)
    assert (cfg.max_concurrency, cfg.max_queue, cfg.api_keys) == (3, 7, ("k1", "k2"))
    assert cfg.allow_remote_images and cfg.image_url_allow_hosts == ("img.example",)
    spec.write_text("mode: two-datacenters\nredis_url: redis://r:6379/0\ndecode: {datacenter: b}\n")
    cfg, host, port, _ = api_config_from(build_parser().parse_args(["serve", "--config", str(spec)]))
    assert (host, port) == ("127.0.0.1", 8000)  # served like ray-cluster (docs/disaggregation.md)
