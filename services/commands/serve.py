"""``sluice serve``: the OpenAI- and Anthropic-compatible API server.

Default (embedded): an in-process engine on the shipped ``trained`` preset
(``models/trained``). ``--model DIR`` serves another checkpoint, ``--preset NAME`` another
preset (``engine.checkpoint.presets``: a random one is generated under
``$SLUICE_HOME/checkpoints/NAME`` on first use); ``--config cluster.yaml`` takes host,
port, admission limits and model from the cluster spec; ``mode: local-cluster`` and
``mode: ray-cluster`` start the disaggregated stack on Ray (``services.ray.launch``:
prefill and decode engine actors, the router, the KV store; docs/disaggregation.md);
``--config FILE --check`` validates the spec, prints the plan derived from it
(``services.ray.cluster_spec.derive``: pools, engines, router, store, unused fields) and
exits without starting anything. Flags beat the file, the file beats ``SLUICE_HOST`` / ``SLUICE_PORT`` /
``SLUICE_MODEL_DIR``. ``--replicas N --router-policy P`` serves N in-process
engine replicas behind the router (``services/routing/client.py``; docs/router.md, "Live
routing"); the default is one engine and no router.

``--store FILE`` gives the engine a KV store for its prefix blocks: FILE is a store spec
(``kvstore.spec``; ``sluice store cluster --redis --spec-out FILE`` writes one), validated
before anything starts (exit 2 when missing or invalid). ``--store local`` starts 12 store
nodes and a redis-server on loopback (``services.local.store.LocalStore``) for the server's
lifetime and stops them on exit, SIGTERM, Ctrl-C or a failed start. The engine receives the
spec's path as ``engine_kwargs["kv_store"]``. ``--device`` and ``--dtype`` reach the engine
the same way (``EngineConfig.device`` / ``.dtype``), for every replica. Without these flags
the engine gets no extra keyword arguments.
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger("sluice.serve")
ROUTER_POLICIES = ("round_robin", "least_load", "cache_aware", "sluice")  # = services.routing.client's
LOCAL_STORE = "local"


def register(sub: argparse._SubParsersAction) -> None:
    from engine.checkpoint.presets import DEFAULT_PRESET, preset_names

    p = sub.add_parser("serve", help="serve the OpenAI/Anthropic-compatible HTTP API")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1, or SLUICE_HOST)")
    p.add_argument(
        "--port", type=int, default=None, help="port (default 8000, or SLUICE_PORT; 0: any free port)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"checkpoint directory (default: SLUICE_MODEL_DIR, else the {DEFAULT_PRESET} preset)",
    )
    which.add_argument(
        "--preset",
        default=None,
        choices=preset_names(),
        help=f"serve a preset instead: {DEFAULT_PRESET} is shipped in models/, the random ones are "
        "generated under $SLUICE_HOME/checkpoints on first use",
    )
    p.add_argument("--config", type=Path, default=None, help="cluster.yaml")
    p.add_argument(
        "--check",
        action="store_true",
        help="with --config: validate the cluster spec, print the plan derived from it and exit "
        "(starts nothing; exit 2 for a bad spec)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="requests generating at once (default 8)"
    )
    p.add_argument("--max-queue", type=int, default=None, help="requests waiting for a slot (default 16)")
    p.add_argument(
        "--allow-image-host",
        action="append",
        default=[],
        metavar="HOST",
        help="enable remote image URLs from this host name (repeatable; private addresses stay refused)",
    )
    p.add_argument(
        "--replicas", type=int, default=1, help="in-process engine replicas behind the router (default 1)"
    )
    p.add_argument(
        "--router-policy",
        default="",
        choices=ROUTER_POLICIES,
        help="prefill routing policy over the replicas (default: none for 1 replica, sluice for more)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="FILE|local",
        help="KV store for the engine's prefix blocks: a store spec JSON (sluice store cluster --redis "
        "--spec-out FILE), or 'local' to run 12 store nodes and Redis on loopback while serving",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="with a ray-cluster spec: the Ray cluster to join (ray.init(address=...); default 'auto')",
    )
    # an API replica started by `serve --config` (api.replicas > 1): it follows the engine
    # actors of DEPLOYMENT and serves on the listening socket it inherited as file descriptor N
    p.add_argument("--attach", default=None, metavar="DEPLOYMENT", help=argparse.SUPPRESS)
    p.add_argument("--api-fd", type=int, default=None, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="engine device (default cpu)")
    p.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16"), help="engine dtype (default float32)"
    )
    p.add_argument(
        "--swa-replay", default=None, choices=("exact", "bounded"),
        help="a prefix hit whose sliding-window state is gone, for requests that do not choose: "
        "exact replay (default; output unchanged) or bounded replay (window - 1 tokens, approximate)",
    )  # fmt: skip
    p.add_argument(
        "--host-swa-mib", type=int, default=None, metavar="MIB",
        help="keep the sliding-window slots of ended turns in a host-memory pool of this size, "
        "so a next turn continues without a replay (default: off)",
    )  # fmt: skip
    p.add_argument(
        "--host-swa-format", default=None, choices=("native", "mxfp8"),
        help="how the host pool stores slots: native (exact, default) or mxfp8 (lossy; used only "
        "by requests that accept approximate state)",
    )  # fmt: skip
    p.add_argument(
        "--host-swa-layers", type=int, default=None, metavar="N",
        help="host slots keep the first N layers' windows only (default: every layer, exact); "
        "fewer is lossy: the other layers are rebuilt by a bounded replay on load",
    )  # fmt: skip
    p.add_argument(
        "--fp8-weights", default=None, choices=("dequantize", "w8a16", "w8a8"),
        help="an FP8 checkpoint's weights: dequantize to bf16 at load (default), or keep them FP8 "
        "on the device times bf16 activations (w8a16) or FP8-quantised ones (w8a8: other numerics; "
        "docs/engine.md)",
    )  # fmt: skip
    p.add_argument(
        "--speculative", default=None, metavar="POLICY",
        help="speculative decoding with the checkpoint's MTP layer: dspark, dspark-lagged or fixed-K, "
        "optionally :N drafts per step (default: off; see docs/speculative.md)",
    )  # fmt: skip
    p.add_argument(
        "--batch-invariant", action="store_true", default=None,
        help="a request's tokens do not depend on what shares its steps (CUDA: Triton kernels "
        "with fixed reduction orders; steps never mix decodes and prefill; docs/engine.md)",
    )  # fmt: skip
    p.add_argument(
        "--spec-profile", default=None, metavar="FILE",
        help="the verification step profile (default: <model>/sluice_spec_steps.json if present)",
    )  # fmt: skip
    p.add_argument(
        "--spec-profile-as-is", dest="spec_measured_costs", action="store_const", const=False, default=None,
        help="DSpark follows the step profile as it is; by default it rescales the profile's prices of plain "
        "and speculating steps by what this engine's own steps take (docs/speculative.md)",
    )  # fmt: skip
    p.add_argument(
        "--swa-directory", default=None, metavar="URL",
        help="share the host pool's slots with other engines through this SWA directory "
        "('memory' or a Redis URL); needs --host-swa-mib",
    )  # fmt: skip
    p.add_argument(
        "--swa-lease-s", type=float, default=None, metavar="S",
        help="with --swa-directory: this engine's lease; its slots stop being offered this long "
        "after it dies (default 10)",
    )  # fmt: skip
    p.set_defaults(func=run)


def preset_dir(name: str) -> Path:
    """The checkpoint directory of preset ``name`` (a random one generated under SLUICE_HOME)."""
    from engine.checkpoint.presets import resolve_preset
    from services import envs

    return resolve_preset(name, envs.HOME.get())


def default_model_dir() -> Path:
    """SLUICE_MODEL_DIR when set, else the shipped default preset (``trained``)."""
    from engine.checkpoint.presets import DEFAULT_PRESET
    from services import envs

    configured = envs.MODEL_DIR.get()
    if configured is not None:
        return configured
    return preset_dir(DEFAULT_PRESET)


def api_config_from(args: argparse.Namespace) -> tuple[object, str, int, Path]:
    from services import envs
    from services.api.config import ApiConfig

    host, port, model = envs.HOST.get(), envs.PORT.get(), args.model
    overrides: dict[str, Any] = {}
    if args.config is not None:
        from services.ray.cluster_spec import load_cluster_spec

        spec = load_cluster_spec(args.config)
        host, port = spec.api.host, spec.api.port
        overrides.update(max_concurrency=spec.api.max_concurrency, max_queue=spec.api.max_queue)
        if model is None and args.preset is None and spec.model:
            model = Path(spec.model)
    host = args.host or host
    port = args.port if args.port is not None else port
    for name in ("max_concurrency", "max_queue"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.allow_image_host:
        overrides.update(allow_remote_images=True, image_url_allow_hosts=tuple(args.allow_image_host))
    keys = envs.API_KEYS.get()
    cfg = ApiConfig(
        host=host, port=port, api_keys=keys, api_keys_file=envs.API_KEYS_FILE.get(),
        admin_keys=envs.ADMIN_KEYS.get(), **overrides,
    )  # fmt: skip
    if model is None:  # --model, --preset, the file's model, SLUICE_MODEL_DIR, the trained preset
        model = preset_dir(args.preset) if args.preset else default_model_dir()
    return cfg, host, port, model


#: flags copied as they are into the ``EngineConfig`` field named beside them, when given
_ENGINE_FLAGS = {
    "device": "device", "dtype": "dtype", "swa_replay": "swa_replay",
    "host_swa_format": "host_swa_format", "host_swa_layers": "host_swa_layers",
    "speculative": "speculative", "spec_profile": "spec_profile_path", "spec_measured_costs": "spec_measured_costs",
    "swa_directory": "swa_directory", "swa_lease_s": "swa_lease_s",
}  # fmt: skip


def engine_kwargs_from(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for every engine (``EngineConfig`` fields) from the flags given;
    empty without them. ValueError for a device this host lacks."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"--device cuda: no CUDA device is available here (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu"
            )
    kwargs: dict[str, Any] = {
        field: getattr(args, flag) for flag, field in _ENGINE_FLAGS.items() if getattr(args, flag) is not None
    }
    if args.host_swa_mib is not None:
        if args.host_swa_mib < 0:
            raise ValueError(f"--host-swa-mib must be >= 0 (0 = off), got {args.host_swa_mib}")
        kwargs["host_swa_bytes"] = args.host_swa_mib << 20
    if args.fp8_weights not in (None, "dequantize"):
        kwargs["keep_quantized"] = True
        kwargs["fp8_compute"] = "w8a8" if args.fp8_weights == "w8a8" else "w8a16"
    if args.batch_invariant:
        kwargs["batch_invariant"] = True
    return kwargs


class _Terminated(BaseException):
    """SIGTERM while a store this server started is up: unwinds so the store stops."""


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises ``_Terminated`` (once) instead of ending the process on the spot, so
    ``finally`` blocks run. uvicorn handles SIGTERM itself while it serves, then raises it
    again with the handler it found: this one."""
    fired = False

    def handler(_sig: int, _frame: object) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _StoreFailed(Exception):
    """The local store did not start."""


@contextmanager
def _store(arg: str) -> Iterator[tuple[Path, Any]]:
    """(spec path, StoreSpec) of ``--store``; a local store runs until the block exits."""
    from kvstore.spec import StoreSpec

    if arg != LOCAL_STORE:
        path = Path(arg).resolve()
        yield path, StoreSpec.load(path)
        return
    from services.local.store import LocalStore

    log.info("starting the local KV store: 12 nodes and redis-server on loopback")
    local = LocalStore()
    try:
        local.start()
    except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
        raise _StoreFailed(f"the local KV store did not start: {exc}") from exc
    try:
        assert local.spec_path is not None and local.spec is not None
        yield local.spec_path, local.spec
    finally:
        local.stop()


def check_config(args: argparse.Namespace) -> int:
    """``--config FILE --check``: the spec's plan (``services.ray.cluster_spec.derive``),
    printed; starts nothing. A bad spec raises ValueError (exit 2, its message)."""
    from services.ray.cluster_spec import derive, load_cluster_spec

    if args.config is None:
        raise ValueError("--check validates a cluster spec: give it with --config FILE")
    spec = load_cluster_spec(args.config)  # its errors name the file
    try:
        plan = derive(spec)
    except ValueError as exc:
        raise ValueError(f"{args.config}: {exc}") from None
    print(f"{args.config}: valid", *plan.summary(), sep="\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from services.api.server import bind_socket
    from services.routing.client import RoutingConfig

    if args.check:
        return check_config(args)
    cfg, host, port, model = api_config_from(args)
    spec = None
    if args.config is not None:
        from services.ray.cluster_spec import load_cluster_spec

        spec = load_cluster_spec(args.config)
    if spec is not None and spec.mode != "embedded":
        return _serve_on_ray(args, spec, cfg, host, port, model)
    routing = RoutingConfig(replicas=args.replicas, policy=args.router_policy).resolve()
    engine_kwargs = engine_kwargs_from(args)
    if args.store not in (None, LOCAL_STORE):
        from kvstore.spec import StoreSpec

        StoreSpec.load(args.store)  # a bad or missing spec: exit 2 before anything starts
    try:  # before the model loads: the port is ours from here on, and port 0 names one
        sock = bind_socket(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        return 2
    if args.store is None:
        return _serve(cfg, routing, sock, host, model, engine_kwargs)
    try:
        with _sigterm_unwinds(), _store(args.store) as (spec_path, spec):
            if not spec.shared:
                log.warning(
                    "store spec %s: directory 'memory' is private to each engine (replica); "
                    "blocks are not shared between replicas or processes",
                    spec_path,
                )
            engine_kwargs["kv_store"] = str(spec_path)
            note = f" with KV store {spec_path} ({spec.describe()})"
            return _serve(cfg, routing, sock, host, model, engine_kwargs, note)
    except _Terminated:  # the store is stopped: end as SIGTERM ends a server without one
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        return 143  # not reached
    except _StoreFailed as exc:
        log.error("%s", exc)
        return 1
    finally:
        sock.close()


def _serve_on_ray(args: argparse.Namespace, spec: Any, cfg: Any, host: str, port: int, model: Path) -> int:
    """The Ray modes of a cluster spec (``services.ray.launch``)."""
    from services.api.server import bind_socket
    from services.ray.launch import serve_cluster

    if args.store == LOCAL_STORE or args.replicas != 1 or args.router_policy:
        raise ValueError(
            f"{args.config}: mode {spec.mode} takes its store, pools and router policy from the spec; "
            "drop --store local, --replicas and --router-policy"
        )
    if args.store is not None:
        from kvstore.spec import StoreSpec

        StoreSpec.load(args.store)  # a bad or missing spec: exit 2 before anything starts
    if args.api_fd is not None:  # an API replica: the socket is the first server's
        import socket

        sock = socket.socket(fileno=args.api_fd)
    else:
        try:
            sock = bind_socket(host, port)
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", host, port, exc)
            return 2
        url_host = f"[{host}]" if ":" in host else host
        print(f"sluice: listening on http://{url_host}:{sock.getsockname()[1]}", flush=True)
    try:
        with _sigterm_unwinds():
            return serve_cluster(
                spec, cfg, sock, host, model, ray_address=args.ray_address,
                store_spec=None if args.store is None else str(args.store),
                config_path=args.config, attach=args.attach,
            )  # fmt: skip
    except (_Terminated, SystemExit) as exc:
        # Ray's driver installs its own SIGTERM handler (sys.exit(15)) over ours; either
        # way everything is stopped now: end as SIGTERM ends a server
        if isinstance(exc, SystemExit) and exc.code != signal.SIGTERM:
            raise
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        return 143  # not reached
    finally:
        sock.close()


def _serve(
    cfg: object,
    routing: Any,
    sock: Any,
    host: str,
    model: Path,
    engine_kwargs: dict[str, Any],
    store_note: str = "",
) -> int:
    import uvicorn

    from services.api.app import create_app
    from services.api.inprocess import InProcessEngineClient
    from services.api.server import uvicorn_config
    from services.routing.client import RoutedEngineClient

    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    print(f"sluice: listening on http://{url_host}:{port}", flush=True)  # launchers read this line
    engine: Any = (
        RoutedEngineClient.in_process(model, routing, **engine_kwargs)
        if routing.routed
        else InProcessEngineClient(model, **engine_kwargs)
    )
    if routing.routed:
        log.info("routing over %d replicas with the %s policy", routing.replicas, routing.policy)
        from router import gctune

        gctune.tune_for_latency()  # the decision-latency tail is mostly GC passes (docs/router.md)
    app = create_app(cfg, engine)  # type: ignore[arg-type]
    if host not in ("127.0.0.1", "::1", "localhost") and not app.state.sluice.config.api_keys:
        log.warning("serving on %s without API keys: set SLUICE_API_KEYS or SLUICE_API_KEYS_FILE", host)
    log.info("serving %s on http://%s:%d%s", model, url_host, port, store_note)
    uvicorn.Server(uvicorn_config(app, cfg, host, port)).run(sockets=[sock])  # type: ignore[arg-type]
    return 0
