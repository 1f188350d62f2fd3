"""``RedisProcess`` against real redis-server processes: a taken port is an error that says
so (never a silent connection to somebody else's server), and ``port=0`` gets past a pick
that another process took first."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest
import redis

from services.local import procs
from services.local.procs import RedisProcess


def test_a_fixed_port_held_by_another_redis_is_a_clear_error(redis_server: RedisProcess) -> None:
    with pytest.raises(RuntimeError, match=f"port {redis_server.port} is taken by another redis-server"):
        RedisProcess(port=redis_server.port).start()


def test_a_fixed_port_held_by_another_listener_is_a_clear_error() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"Failed listening on port {port}"):
            RedisProcess(port=port).start(timeout_s=5)


def test_port_zero_tries_again_when_its_pick_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lost = taken.getsockname()[1]
        picks = iter([lost])  # the first pick loses the race; later ones are real
        real_free_port = procs.free_port
        monkeypatch.setattr(
            procs, "free_port", lambda host="127.0.0.1": next(picks, 0) or real_free_port(host)
        )
        with RedisProcess() as server:
            assert server.port != lost
            assert redis.Redis.from_url(server.url).ping()


def test_a_password_reaches_redis_in_a_private_file_never_in_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off loopback ``RedisProcess`` draws a password (protected mode refuses remote clients
    without one); given one, it goes to redis-server through a 0600 config file that is gone
    once the server answers, not through argv (which every local user can read)."""
    secret = "pw-" + "9" * 29
    confs: list[Path] = []  # the config files this server's start wrote
    private_config = procs._private_config

    def recorded(text: str) -> Path:
        confs.append(private_config(text))
        return confs[-1]

    monkeypatch.setattr(procs, "_private_config", recorded)
    with RedisProcess(password=secret) as r:
        assert r.url == f"redis://:{secret}@127.0.0.1:{r.port}/0"
        cmdline = Path(f"/proc/{r.proc.pid}/cmdline").read_bytes().decode()
        assert secret not in cmdline
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=r.port).ping()
        assert redis.Redis.from_url(r.url).ping()
        # this server's config files (one a start attempt; another test's server may hold its
        # own at this moment, so not every sluice-redis-*.conf in the temporary directory)
        assert confs and all(c.parent == Path(tempfile.gettempdir()) for c in confs)
        assert not any(c.exists() for c in confs)
    assert "pw" not in repr(RedisProcess(password=secret))
