import subprocess
import sys

import pytest

from services.cli import build_parser, main


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"env", "gen-checkpoint", "bench"} <= set(sub.choices)
    for name in sub.choices:
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_env_command_rejects_a_malformed_value(monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_PORT", "not-a-port")
    assert main(["env"]) == 2
    assert "SLUICE_PORT" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "env"], capture_output=True, text=True, check=True
    ).stdout
    assert "SLUICE_MODEL_DIR" in out


def test_the_parser_loads_without_torch():
    """Every `sluice` command builds the whole parser first; the commands that need torch
    import it when they run, so `sluice store ...` or `--help` does not pay for it (~2 s)."""
    probe = "import sys; from services.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_gen_checkpoint_rejects_bad_override(tmp_path, capsys):
    assert main(["gen-checkpoint", "--out", str(tmp_path), "--set", "novalue"]) == 2
    assert "KEY=JSON" in capsys.readouterr().err


def test_admin_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.delenv("SLUICE_ADMIN_KEYS", raising=False)
    assert main(["admin", "engines"]) == 2
    assert "SLUICE_ADMIN_KEYS" in capsys.readouterr().err
    monkeypatch.setenv("SLUICE_ADMIN_KEYS", "k")
    assert main(["admin", "drain"]) == 2
    assert "engine's name" in capsys.readouterr().err
    # nothing listens on port 9 of loopback: refused, said plainly, no traceback
    assert main(["admin", "engines", "--url", "http://127.0.0.1:9"]) == 2
    assert "cannot reach" in capsys.readouterr().err
