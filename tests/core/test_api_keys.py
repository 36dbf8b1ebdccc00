"""API keys: issued with scopes, stored hashed, checked in constant time; which scope each
route needs; when keys are enforced."""

from __future__ import annotations

import msgspec
import pytest

from arena_core import apikeys
from arena_core.apikeys import KeyRing, enforced, new_key, scope_for


def test_a_key_is_checked_against_its_hash_and_never_stored_in_clear():
    key, record = new_key("trainer", ["read"])
    assert key.startswith("ak_") and key not in record.sha256 and record.key_id in key
    ring = KeyRing()
    ring.keys[record.key_id] = record
    assert ring.check(key) == record
    assert ring.check(key[:-1] + ("x" if key[-1] != "x" else "y")) is None  # same id, wrong secret
    assert ring.check("ak_unknown_secret") is None and ring.check("") is None and ring.check(None) is None
    ring.keys[record.key_id] = msgspec.structs.replace(record, revoked=True)
    assert ring.check(key) is None  # revoked


def test_scopes_admin_covers_all_and_unknown_scopes_are_refused():
    _, reader = new_key("r", ["read"])
    _, admin = new_key("a", ["admin"])
    assert reader.allows("read") and not reader.allows("submit")
    assert admin.allows("read") and admin.allows("submit")
    with pytest.raises(ValueError, match="scopes"):
        new_key("x", ["write"])
    with pytest.raises(ValueError, match="scopes"):
        new_key("x", [])


def test_each_route_needs_read_to_look_and_submit_to_change_health_and_proxies_are_apart():
    assert scope_for("GET", "/v1/rollouts") == "read"
    assert scope_for("GET", "/v1/trajectories/r1") == "read"
    assert scope_for("POST", "/v1/rollouts") == "submit"
    assert scope_for("POST", "/v1/rollouts/r1/cancel") == "submit"
    assert scope_for("POST", "/v1/trainer-metrics") == "submit"
    # a bundle's bytes are a task's files (hidden tests included): the scope that uploads them
    assert scope_for("GET", f"/v1/bundles/sha256:{'0' * 64}/archive") == "submit"
    assert scope_for("GET", f"/v1/bundles/sha256:{'0' * 64}") == "read"
    # a project's quotas are the administrator's to set; a method no route has is the router's 405
    assert scope_for("PUT", "/v1/projects/alpha") == "admin"
    assert scope_for("GET", "/v1/projects") == "read"
    assert scope_for("TRACE", "/v1/projects/alpha") == "submit"
    for public in ("/healthz", "/readyz", "/openapi.json"):
        assert scope_for("GET", public) is None
    # the LLM proxy and the judge route take their own keys (the rollout's, the judge's)
    assert scope_for("POST", "/proxy/r1/v1/chat/completions") is None
    assert scope_for("POST", "/judge/r1/v1/chat/completions") is None


def test_keys_are_enforced_on_every_host_unless_off():
    assert enforced("keys", "127.0.0.1") and enforced("auto", "0.0.0.0") and enforced("auto", "10.0.0.5")
    assert enforced("auto", "127.0.0.1") and enforced("auto", "::1")
    assert not enforced("off", "127.0.0.1") and not enforced("off", "0.0.0.0")
    with pytest.raises(ValueError):
        enforced("maybe", "0.0.0.0")


def test_clients_send_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("ARENA_API_KEY", "ak_1_s")
    assert apikeys.auth_headers() == {"authorization": "Bearer ak_1_s"}
    assert apikeys.auth_headers("ak_2_t") == {"authorization": "Bearer ak_2_t"}
    monkeypatch.delenv("ARENA_API_KEY")
    assert apikeys.auth_headers() == {}


def test_a_key_belongs_to_one_project_and_keys_stored_before_projects_are_the_default_ones():
    key, record = new_key("team", ["submit", "read"], "alpha")
    assert record.project == "alpha" and record.sees("alpha") and not record.sees("beta")
    _, admin = new_key("ops", ["admin"], "alpha")
    assert admin.sees("beta")  # an admin key sees every project
    # a record as stored before projects existed (no project field) loads as the default project's
    old = msgspec.json.encode({k: v for k, v in msgspec.to_builtins(record).items() if k != "project"})
    assert b"project" not in old
    loaded = msgspec.json.decode(old, type=apikeys.ApiKey)
    assert loaded.project == "default" and loaded.key_id == record.key_id
    ring = KeyRing()
    ring.keys[loaded.key_id] = loaded
    assert ring.check(key) == loaded  # and still works
    assert new_key("x", ["read"])[1].project == "default"
    for bad in ("", "a/b", "a.b", "-x", "x" * 65, "a b"):
        with pytest.raises(ValueError, match="project name"):
            new_key("x", ["read"], bad)


def test_owners_hide_another_projects_objects_and_refuse_another_keys_changes():
    from arena_core import owners
    from arena_core.errors import Forbidden, NotFound

    _, a1 = new_key("a1", ["submit", "read"], "alpha")
    _, a2 = new_key("a2", ["submit", "read"], "alpha")
    _, b = new_key("b", ["submit", "read"], "beta")
    _, admin = new_key("admin", ["admin"], "ops")
    assert owners.project_of(a1) == "alpha" and owners.project_of(None) == "default"
    assert owners.listing_project(a1) == "alpha" and owners.listing_project(admin) is None
    assert owners.listing_project(None) is None  # keys off: everything
    owners.visible("alpha", a2, "no rollout 'r'")
    with pytest.raises(NotFound, match="no rollout 'r'"):
        owners.visible("alpha", b, "no rollout 'r'")
    owners.visible("alpha", admin, "x")
    owners.visible("alpha", None, "x")
    with pytest.raises(Forbidden):
        owners.check(a1.key_id, a2, "rollout r")
    owners.check(a1.key_id, admin, "rollout r")
    assert owners.scoped_name("default", "env") == "env" and owners.scoped_name("alpha", "env") == "alpha/env"
    assert owners.split_scoped("alpha/env") == ("alpha", "env") and owners.split_scoped("env") == ("default", "env")
