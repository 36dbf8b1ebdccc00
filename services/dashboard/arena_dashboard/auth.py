"""Browser sign-in when API keys are enforced: a key with the ``read`` scope, given once
(``/?key=`` or the sign-in form), kept in an HttpOnly, SameSite=Strict cookie and checked
against the ``KeyRing`` on every request, so a revoked key stops working at once."""

from __future__ import annotations

from http.cookies import SimpleCookie

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
<h1>Arena</h1><p>This dashboard asks for an API key with the <b>read</b> scope
(<code>arena keys create --name me --scope read</code>; <code>arena up</code> writes one to
<code>$ARENA_DATA_DIR/api-key</code>).</p>
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


def set_cookie(key: str, *, secure: bool) -> str:
    return (f"{COOKIE}={key}; Path=/; HttpOnly; SameSite=Strict; Max-Age={COOKIE_AGE_S}"
            + ("; Secure" if secure else ""))


def clear_cookie() -> str:
    return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"


class Gate:
    """Whether a request may see the dashboard: always when keys are not enforced (``ring``
    None), else with a known key that allows ``read``."""

    def __init__(self, ring: KeyRing | None):
        self.ring = ring

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

    def ready(self) -> bool:
        return self.ring is None or self.ring.ready.is_set()
