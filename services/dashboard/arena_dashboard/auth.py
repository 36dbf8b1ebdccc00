"""Browser sign-in when API keys are enforced. Two ways in, both ending in a read-only key kept
in an HttpOnly, SameSite=Strict cookie and checked against the ``KeyRing`` on every request
(a revoked or expired key stops working at once):

- ``/?token=<sign-in token>``: a one-time, short-lived token (``apikeys.issue_sign_in_token``,
  what ``arena up`` prints), used once for the read-only session key it opens;
- the sign-in form (``POST /login``) with a read-only API key.

No API key is taken from an address (``/?key=`` is refused: addresses end up in histories,
logs and referrers), and a sign-in from another site is refused (login CSRF): the form's
``Origin`` (else ``Referer``) must be the dashboard's own, and a browser's ``Sec-Fetch-Site``
must say the request came from the dashboard or from no site (an address typed or opened
from a terminal). docs/dashboard.md ("Signing in")."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from urllib.parse import urlsplit

from arena_core import owners
from arena_core.apikeys import KeyRing

COOKIE = "arena_dashboard_key"
#: Anyone may fetch these: health, the sign-in page and what it needs.
PUBLIC = frozenset({"/healthz", "/readyz", "/login", "/static/app.css", "/favicon.ico"})
COOKIE_AGE_S = 30 * 86400

LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Arena dashboard: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/static/app.css"></head>
<body class="login"><form method="post" action="/login" class="card login-card">
<h1>Arena</h1><p>Open the one-time sign-in link <code>arena up</code> prints, or sign in with a
read-only API key (<code>arena keys create --name me --scope read</code>).</p>
{problem}
<label>API key <input type="password" name="key" autocomplete="current-password" autofocus required
maxlength="200"></label>
<button type="submit">Sign in</button></form></body></html>
"""


def cookie_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key in the dashboard's cookie, if any."""
    for name, value in headers:
        if name == b"cookie":
            jar = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # noqa: BLE001 - a malformed cookie header: no key
                continue
            if COOKIE in jar:
                return jar[COOKIE].value
    return None


def bearer_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            raw = value.decode("latin-1")
            if raw[:7].lower() == "bearer ":
                return raw[7:].strip()
    return None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _origin(url: str) -> str | None:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else None


def cross_site(headers: list[tuple[bytes, bytes]], own_origin: str, *, form: bool) -> str | None:
    """Why a sign-in request did not come from the dashboard itself, or None when it did.
    ``own_origin``: ``scheme://host[:port]`` as the browser addressed the dashboard. ``form``:
    a POST, which a browser sends with ``Origin``; a navigation (``GET /?token=``) has none,
    and is judged by ``Sec-Fetch-Site`` alone."""
    fetch_site = _header(headers, b"sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return f"the browser says this sign-in came from another site (Sec-Fetch-Site: {fetch_site})"
    if not form:
        return None
    origin = _header(headers, b"origin")
    if origin is None:
        referer = _header(headers, b"referer")
        origin = _origin(referer) if referer else None
    if origin is not None and origin.lower() != own_origin.lower():
        return f"this sign-in was posted from {origin[:100]}, not from this dashboard"
    return None


def set_cookie(key: str, *, secure: bool) -> str:
    return (f"{COOKIE}={key}; Path=/; HttpOnly; SameSite=Strict; Max-Age={COOKIE_AGE_S}"
            + ("; Secure" if secure else ""))


def clear_cookie() -> str:
    return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"


class Gate:
    """Whether a request may see the dashboard: always when keys are not enforced (``ring``
    None), else with a known key that allows ``read`` (in the cookie, a read-only one).
    ``redeem``: uses a sign-in token once and answers the session key it opens
    (``apikeys.redeem_sign_in_token`` on the bus), raising ``apikeys.SignInRefused``."""

    def __init__(self, ring: KeyRing | None, redeem: Callable[[str], Awaitable[str]] | None = None):
        self.ring = ring
        self.redeem = redeem

    @property
    def enforced(self) -> bool:
        return self.ring is not None

    def key_of(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        return bearer_key(headers) or cookie_key(headers)

    def allows(self, key: str | None) -> bool:
        if self.ring is None:
            return True
        record = self.ring.check(key) if key else None
        return record is not None and record.allows("read")

    def allows_request(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """A bearer key that allows ``read`` (scripts), or a cookie's read-only key: a cookie
        never carries more than read (one set by an older dashboard with the CLI's key no
        longer passes)."""
        if self.ring is None:
            return True
        bearer = bearer_key(headers)
        if bearer:
            return self.allows(bearer)
        return self.signs_in(cookie_key(headers))

    def signs_in(self, key: str | None) -> bool:
        """Whether ``key`` may go into the cookie: a known, read-only key."""
        if self.ring is None:
            return True
        record = self.ring.check(key) if key else None
        return record is not None and record.read_only and record.allows("read")

    def project_of(self, key: str | None) -> str | None:
        """The one project whose live events ``key``'s session receives; ``None``: every project
        (keys off, or an admin key)."""
        if self.ring is None:
            return None
        record = self.ring.check(key) if key else None
        return owners.listing_project(record) if record is not None else owners.DEFAULT_PROJECT

    def ready(self) -> bool:
        return self.ring is None or self.ring.ready.is_set()
