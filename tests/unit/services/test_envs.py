import pytest

from services import envs


def test_defaults_parse_from_an_empty_environment():
    values = envs.snapshot({})
    assert values["SLUICE_PORT"] == 8000
    assert values["SLUICE_HOST"] == "127.0.0.1"
    assert values["SLUICE_MODEL_DIR"] is None
    assert values["SLUICE_API_KEYS"] == ()


def test_typed_values_parse():
    env = {"SLUICE_PORT": "9001", "SLUICE_API_KEYS": "a, b,,c", "SLUICE_DETERMINISTIC": "off"}
    assert envs.PORT.get(env) == 9001
    assert envs.API_KEYS.get(env) == ("a", "b", "c")
    assert envs.DETERMINISTIC.get(env) is False


@pytest.mark.parametrize(("name", "raw"), [("SLUICE_PORT", "eighty"), ("SLUICE_DETERMINISTIC", "maybe")])
def test_malformed_value_names_the_variable(name, raw):
    with pytest.raises(ValueError, match=name):
        envs.REGISTRY[name].get({name: raw})


def test_every_variable_has_the_prefix_and_help():
    for name, var in envs.REGISTRY.items():
        assert name.startswith("SLUICE_")
        assert var.help


def test_only_the_registry_reads_the_environment():
    """CONVENTIONS 10: one registry; no os.getenv / os.environ reads elsewhere in product code."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    offenders = []
    for pkg in ("engine", "router", "costmodel", "kvstore", "services"):
        for path in (root / pkg).rglob("*.py"):
            if path.name == "envs.py" and path.parent.name == "services":
                continue
            text = path.read_text(encoding="utf-8")
            if re.search(r"os\.getenv|os\.environ", text):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
