"""The operator endpoints (``services/api/admin.py``) on a real server over one in-process
engine: off without admin keys, never opened by a client's key, and 404 where there are no
engine pools to drain. Draining pools: ``tests/integration/ray/test_grpc_handoff.py``."""

from __future__ import annotations

import httpx
import pytest

from services.api.config import ApiConfig
from tests.integration.api.conftest import API_KEYS, _serve

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-tests"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_admin_endpoints_are_off_without_admin_keys(api_server):
    r = httpx.get(f"{api_server.url}/admin/engines", headers=_bearer(API_KEYS[0]))
    assert r.status_code == 403 and "SLUICE_ADMIN_KEYS" in r.json()["error"]["message"]
    r = httpx.post(f"{api_server.url}/admin/engines/decode-0/drain", headers=_bearer(API_KEYS[0]))
    assert r.status_code == 403


@pytest.fixture(scope="module")
def admin_server(tiny_model):
    yield from _serve(tiny_model, ApiConfig(api_keys=API_KEYS, admin_keys=(ADMIN,)))


def test_admin_and_client_keys_open_only_their_own_endpoints(admin_server):
    url = admin_server.url
    for headers in ({}, _bearer(API_KEYS[0]), {"x-api-key": API_KEYS[1]}, _bearer(ADMIN + "x")):
        r = httpx.get(f"{url}/admin/engines", headers=headers)
        assert r.status_code == 401, headers
        assert "admin key" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/models", headers=_bearer(ADMIN))
    assert r.status_code == 401, "an admin key is not a client key"
    assert httpx.get(f"{url}/v1/models", headers=_bearer(API_KEYS[0])).status_code == 200


def test_one_engine_has_no_pools_to_drain(admin_server):
    for method, path in (("GET", "/admin/engines"), ("POST", "/admin/engines/prefill-0/drain")):
        r = httpx.request(method, f"{admin_server.url}{path}", headers={"x-api-key": ADMIN})
        assert r.status_code == 404 and "one engine" in r.json()["error"]["message"], path


@pytest.mark.parametrize("keys", [("",), ("a:agent",)])
def test_admin_keys_are_checked_at_start(keys):
    with pytest.raises(ValueError, match="admin_keys"):
        ApiConfig(admin_keys=keys)
