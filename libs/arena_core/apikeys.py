"""API keys for the rollout and trajectory APIs: scoped, stored hashed in NATS, checked on
every route but health. docs/deploy.md ("Authentication").

A key is ``ak_<id>_<secret>``; the ``arena_api_keys`` bucket holds ``<id>`` -> ``ApiKey``
(the secret's SHA-256, never the secret). ``KeyGuard`` wraps an ASGI app. Every key belongs to
one project (``default`` unless made with another; a record stored before projects existed
reads as ``default``); an admin key sees every project. docs/projects.md.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from typing import Literal

import msgspec

from arena_core import subjects
from arena_core.bus import follow_kv
from arena_core.schemas import DEFAULT_PROJECT, PROJECT_PATTERN  # a key made without one, a record from before projects

log = logging.getLogger("arena.apikeys")

Scope = Literal["submit", "read", "admin"]
PROJECT_RE = re.compile(PROJECT_PATTERN)
SCOPES: tuple[Scope, ...] = ("submit", "read", "admin")
PREFIX = "ak_"
#: Routes anyone may call: liveness and readiness (supervisors and load balancers), and the
#: API's own description. The LLM proxy (``/proxy``) and the judge route (``/judge``) take
#: their own keys (each rollout's, the judge's).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
OWN_KEYS = ("/proxy/", "/judge/")
#: OpenEnv's client sends no headers: its base URL may carry the key instead,
#: ``/openenv/k/{key}/{name}`` (docs/openenv.md, "Authentication").
OPENENV_KEYED = "/openenv/k/"
#: A bundle's bytes, ``GET /v1/bundles/{digest}/archive``: the ``submit`` scope (:func:`scope_for`).
BUNDLES, BUNDLE_ARCHIVE = "/v1/bundles/", "/archive"
#: ``PUT /v1/projects/{project}``, a project's quotas: the ``admin`` scope (:func:`scope_for`).
PROJECTS = "/v1/projects/"
#: Where ``KeyGuard`` leaves the record of the key that called (an ASGI scope extension):
#: routes read it with :func:`caller` to record and check who owns what (``arena_core.owners``).
CALLER = "arena.api_key"


def path_key(path: str) -> str | None:
    """The key in an ``/openenv/k/{key}/...`` path, or ``None``."""
    if not path.startswith(OPENENV_KEYED):
        return None
    key, _, _ = path[len(OPENENV_KEYED):].partition("/")
    return key or None


def without_path_key(scope: dict) -> dict:
    """``scope`` with ``/openenv/k/{key}`` read as ``/openenv`` (the routes see one form)."""
    path = scope["path"]
    _, _, rest = path[len(OPENENV_KEYED):].partition("/")
    new = "/openenv/" + rest
    out = dict(scope)
    out["path"] = new
    out["raw_path"] = new.encode()
    return out


class SignIn(msgspec.Struct, frozen=True, kw_only=True):
    """What makes a record a one-time dashboard sign-in token, never an API key: the id of the
    read-only session key it opens, and the salt that derives that key's secret from the token."""

    session_id: str
    salt: str


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    key_id: str
    name: str
    scopes: list[Scope]
    sha256: str  # of the whole key
    created_at: float
    revoked: bool = False
    #: when it stops working (seconds since the epoch); 0: never
    expires_at: float = 0.0
    #: set on a dashboard sign-in token (``issue_sign_in_token``): no API takes it as a key
    sign_in: SignIn | None = None
    #: the project whose objects it sees and makes (an admin key sees every project's)
    project: str = DEFAULT_PROJECT

    def allows(self, scope: Scope) -> bool:
        return not self.revoked and (scope in self.scopes or "admin" in self.scopes)

    def expired(self, now: float | None = None) -> bool:
        return bool(self.expires_at) and (time.time() if now is None else now) >= self.expires_at

    def sees(self, project: str) -> bool:
        """Whether objects of ``project`` exist for this key: its own project's, or any with an admin key."""
        return self.project == project or "admin" in self.scopes

    @property
    def read_only(self) -> bool:
        return self.scopes == ["read"]


def check_project(project: str) -> str:
    """``project`` when it is a valid project name, else ``ValueError`` saying what one is."""
    if not isinstance(project, str) or not PROJECT_RE.fullmatch(project):
        raise ValueError(f"a project name is 1-64 letters, digits, '-' or '_', starting with a letter or digit "
                         f"(got {project!r})")
    return project


def new_key(name: str, scopes: list[Scope], project: str = DEFAULT_PROJECT) -> tuple[str, ApiKey]:
    """(the key to hand over once, its stored record)."""
    unknown = [s for s in scopes if s not in SCOPES]
    if not scopes or unknown:
        raise ValueError(f"scopes must be among {', '.join(SCOPES)} (got {', '.join(scopes) or 'none'})")
    check_project(project)
    key_id = secrets.token_hex(6)
    key = f"{PREFIX}{key_id}_{secrets.token_urlsafe(24)}"
    return key, ApiKey(key_id=key_id, name=name, scopes=list(dict.fromkeys(scopes)), sha256=_digest(key),
                       created_at=time.time(), project=project)


async def issue(bus, name: str, scopes: list[Scope], project: str = DEFAULT_PROJECT) -> tuple[str, ApiKey]:
    """A new key of ``project`` stored in ``arena_api_keys``: (the key, shown once; its record)."""
    key, record = new_key(name, scopes, project)
    await (await bus.kv(subjects.KV_API_KEYS)).put(record.key_id, msgspec.json.encode(record))
    return key, record


async def listing(bus) -> list[ApiKey]:
    kv = await bus.kv(subjects.KV_API_KEYS)
    try:
        ids = await kv.keys()
    except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
        return []
    # projects' quotas live beside the keys under their own prefix (arena_core.quotas)
    records = [msgspec.json.decode((await kv.get(i)).value, type=ApiKey) for i in ids if "." not in i]
    return sorted(records, key=lambda r: r.created_at)


async def revoke(bus, key_id: str) -> ApiKey:
    """Mark a key revoked (kept, so its id is never reused or silently forgotten)."""
    from arena_core.errors import NotFound

    kv = await bus.kv(subjects.KV_API_KEYS)
    try:
        record = msgspec.json.decode((await kv.get(key_id)).value, type=ApiKey)
    except Exception:  # noqa: BLE001 - KeyNotFoundError and friends
        raise NotFound(f"no API key {key_id!r}") from None
    record = msgspec.structs.replace(record, revoked=True)
    await kv.put(key_id, msgspec.json.encode(record))
    return record


SIGN_IN_PREFIX = "st_"
#: How long a sign-in token may wait for its one use, and how long the session it opens lasts.
SIGN_IN_TTL_S = 600.0
SESSION_S = 30 * 86400.0


async def issue_sign_in_token(bus, *, ttl_s: float = SIGN_IN_TTL_S, session_s: float = SESSION_S,
                              name: str = "dashboard sign-in", project: str = DEFAULT_PROJECT) -> str:
    """A one-time, read-only sign-in token for the dashboard (``{dashboard}/?token=<it>``),
    usable once within ``ttl_s``; no API takes it as a key. Stored in ``arena_api_keys`` beside
    the read-only session key it opens (valid ``session_s``, revocable as any key, its secret
    derived from the token and a salt kept in the token's record, so nobody holds it before the
    token is used). docs/dashboard.md ("Signing in")."""
    if not 0 < ttl_s <= 86400 or not 0 < session_s <= 365 * 86400:
        raise ValueError("a sign-in token lives at most a day and its session at most a year")
    check_project(project)
    now = time.time()
    token_id, session_id = secrets.token_hex(6), secrets.token_hex(6)
    token = f"{SIGN_IN_PREFIX}{token_id}_{secrets.token_urlsafe(24)}"
    salt = secrets.token_urlsafe(16)
    session = ApiKey(key_id=session_id, name=name, scopes=["read"], sha256=_digest(_session_key(token, session_id, salt)),
                     created_at=now, expires_at=now + session_s, project=project)
    record = ApiKey(key_id=token_id, name=f"{name} (one-time token)", scopes=["read"], sha256=_digest(token),
                    created_at=now, expires_at=now + ttl_s, sign_in=SignIn(session_id=session_id, salt=salt),
                    project=project)
    kv = await bus.kv(subjects.KV_API_KEYS)
    await kv.put(session_id, msgspec.json.encode(session))
    await kv.put(token_id, msgspec.json.encode(record))
    return token


class SignInRefused(Exception):
    """The token is unknown, used already, expired or revoked (the message says which, no secret)."""


async def redeem_sign_in_token(bus, token: str) -> str:
    """Use a sign-in token, once: the read-only session key it opens. The token's record is
    purged from the bucket's stream, which removes something for one caller only, whichever
    replica it is; any later use is refused (:class:`SignInRefused`)."""
    token_id = _token_id(token)
    if token_id is None:
        raise SignInRefused("that is not a sign-in token")
    kv = await bus.kv(subjects.KV_API_KEYS)
    try:
        entry = await kv.get(token_id)
    except Exception:  # noqa: BLE001 - KeyNotFoundError and friends: used (deleted) or never issued
        raise SignInRefused("unknown or already used sign-in token") from None
    try:
        record = msgspec.json.decode(entry.value, type=ApiKey)
    except msgspec.DecodeError:
        raise SignInRefused("unknown or already used sign-in token") from None
    if record.sign_in is None or not hmac.compare_digest(record.sha256, _digest(token)):
        raise SignInRefused("unknown or already used sign-in token")
    if record.revoked or record.expired():
        raise SignInRefused("that sign-in token has expired: ask `arena up` (or `arena keys`) for a new one")
    if not await _purge(bus, token_id):
        raise SignInRefused("unknown or already used sign-in token")
    return _session_key(token, record.sign_in.session_id, record.sign_in.salt)


async def _purge(bus, key_id: str) -> bool:
    """Remove ``key_id``'s entry from the bucket's stream (a purge of its subject, which the
    stream's leader runs one at a time): True for the one caller that removed something."""
    stream = f"KV_{subjects.KV_API_KEYS}"
    request = msgspec.json.encode({"filter": f"$KV.{subjects.KV_API_KEYS}.{key_id}"})
    try:
        msg = await bus.nc.request(f"$JS.API.STREAM.PURGE.{stream}", request, timeout=5.0)
        answer = msgspec.json.decode(msg.data)
    except Exception as exc:  # noqa: BLE001 - the bus cannot say: the token stays unused
        log.warning("could not use a sign-in token: %s", exc)
        return False
    return bool(answer.get("success")) and answer.get("purged", 0) > 0


def _token_id(token: str) -> str | None:
    if not token.startswith(SIGN_IN_PREFIX) or len(token) > 200:
        return None
    token_id, sep, _ = token[len(SIGN_IN_PREFIX):].partition("_")
    return token_id if sep and token_id.isalnum() else None


def _session_key(token: str, session_id: str, salt: str) -> str:
    secret = base64.urlsafe_b64encode(hmac.new(token.encode(), salt.encode(), hashlib.sha256).digest())
    return f"{PREFIX}{session_id}_{secret.rstrip(b'=').decode()}"


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The header a client sends: ``api_key``, else ``ARENA_API_KEY``; none when neither is set."""
    key = api_key if api_key is not None else os.environ.get("ARENA_API_KEY", "")
    return {"authorization": f"Bearer {key}"} if key else {}


def caller(scope) -> ApiKey | None:
    """The record of the key that made this request (``KeyGuard`` checked it), or ``None``
    when keys are not enforced or the route takes none."""
    return scope.get(CALLER)


def key_id_of(key: str) -> str | None:
    if not key.startswith(PREFIX):
        return None
    key_id, sep, _ = key[len(PREFIX):].partition("_")
    return key_id if sep and key_id else None


def scope_for(method: str, path: str) -> Scope | None:
    """The scope a request needs; None for a public route or one with its own keys. A bundle's
    bytes (``GET /v1/bundles/{digest}/archive``) need ``submit``, the scope that uploads them: a
    task's files, hidden tests included, are not for read-only keys (dashboard sessions). Setting
    a project's quotas (``PUT /v1/projects/{project}``) needs ``admin``."""
    if path in PUBLIC_PATHS or path.startswith(OWN_KEYS):
        return None
    if path.startswith(BUNDLES) and path.endswith(BUNDLE_ARCHIVE):
        return "submit"
    if path.startswith(PROJECTS) and method == "PUT":
        return "admin"  # a project's quotas and priority (docs/projects.md); other methods: 405 from the router
    return "read" if method in ("GET", "HEAD", "OPTIONS") else "submit"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
Auth = Literal["auto", "keys", "off"]


def enforced(auth: str, host: str) -> bool:
    """Whether keys are checked: always (``auto``, the default, and ``keys``) unless the user
    turned them off with ``off``, on any host, loopback included (another local user reaches
    a loopback port too)."""
    if auth not in ("auto", "keys", "off"):
        raise ValueError(f"ARENA_AUTH must be auto, keys or off, got {auth!r}")
    return auth != "off"


def protect(app, bus, *, auth: str, host: str) -> tuple[object, list]:
    """``app`` behind a ``KeyGuard`` when keys are enforced, with the ``KeyRing`` to run
    beside it (a runner of ``arena_core.runtime.serve``); with ``ARENA_AUTH=off``, ``app``
    as it is and a warning, at every start."""
    if not enforced(auth, host):
        log.warning("ARENA_AUTH=off: the API on %s asks for no key; anyone who reaches it may use it", host)
        return app, []
    ring = KeyRing(bus)
    return KeyGuard(app, ring), [ring]


class KeyRing:
    """The bucket's keys, followed by a watch; ``check`` answers from memory."""

    def __init__(self, bus=None) -> None:
        self.bus = bus
        self.keys: dict[str, ApiKey] = {}
        self.ready = asyncio.Event()
        self._decoder = msgspec.json.Decoder(ApiKey)

    def check(self, key: str | None) -> ApiKey | None:
        """The key's record when ``key`` is a known, unrevoked, unexpired key (never a sign-in
        token); else None."""
        key_id = key_id_of(key) if key else None
        record = self.keys.get(key_id) if key_id else None
        if record is None or record.revoked or record.sign_in is not None or record.expired() \
                or not hmac.compare_digest(record.sha256, _digest(key)):
            return None
        return record

    async def run(self, stop: asyncio.Event) -> None:
        """Follow ``arena_api_keys`` on the bus until ``stop``."""
        await self.watch(await self.bus.kv(subjects.KV_API_KEYS), stop)

    async def watch(self, kv, stop: asyncio.Event) -> None:
        def on_entry(entry) -> None:
            if "." in entry.key:  # not a key: a project's quotas (``projects.<name>``, arena_core.quotas)
                return
            if entry.value is None or entry.operation is not None:  # deleted or purged
                self.keys.pop(entry.key, None)
                return
            try:
                self.keys[entry.key] = self._decoder.decode(entry.value)
            except msgspec.DecodeError as exc:
                log.error("arena_api_keys entry %s is not an ApiKey: %s", entry.key, exc)

        await follow_kv(kv, stop, on_entry, self.ready.set)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


class KeyGuard:
    """ASGI middleware: a request to a guarded route needs ``Authorization: Bearer <key>`` (or
    ``X-Api-Key``) of a key with the route's scope: 401 without a known key, 403 with one of
    another scope, 503 until the keys are loaded."""

    def __init__(self, app, ring: KeyRing):
        self.app, self.ring = app, ring

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        websocket = scope["type"] == "websocket"
        needed = "submit" if websocket else scope_for(scope.get("method", "GET"), scope["path"])
        if needed is None:
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        auth = _header(headers, b"authorization") or ""
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else _header(headers, b"x-api-key")
        key = path_key(scope["path"]) or key
        deny = self._close if websocket else self._deny
        if not self.ring.ready.is_set():
            await deny(send, 503, "unavailable", "API keys are not loaded yet; retry shortly")
            return
        record = self.ring.check(key)
        if record is None:
            why = "an API key is required (Authorization: Bearer <key>; `arena keys create`)" if not key \
                else "unknown or revoked API key"
            await deny(send, 401, "unauthorized", why)
            return
        if not record.allows(needed):
            await deny(send, 403, "forbidden",
                       f"API key {record.key_id} ({record.name}) lacks the {needed!r} scope for "
                       f"{scope.get('method', 'WEBSOCKET')} {scope['path']} (it has: {', '.join(record.scopes)})")
            return
        scope[CALLER] = record  # who called: the routes record and check owners with it
        await self.app(scope, receive, send)

    async def _close(self, send, status: int, code: str, message: str) -> None:
        """A WebSocket refused before its handshake completes: the client sees HTTP 403."""
        await send({"type": "websocket.close", "code": 1008, "reason": f"{code}: {message}"[:120]})

    async def _deny(self, send, status: int, code: str, message: str) -> None:
        body = msgspec.json.encode({"error": {"code": code, "message": message}})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="arena"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
