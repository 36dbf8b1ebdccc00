"""The trajectory API as the dashboard reads it: GETs with validated parameters, its errors
mapped to ``ArenaError``s with the upstream's own code, transport failures to 502/504."""

from __future__ import annotations

import logging

import httpx
import msgspec

from arena_core.errors import ArenaError, UpstreamError

log = logging.getLogger("arena.dashboard.upstream")


class UpstreamAnswer(ArenaError):
    """The trajectory API answered with an error: its status and code, passed on."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code


class UpstreamTimeout(ArenaError):
    code = "upstream_timeout"
    status = 504


class TrajectoryApi:
    """GET JSON from the trajectory API at ``base_url``. ``api_key``: this service's own
    (``ARENA_API_KEY``); without it, the browser's key (already checked) is sent on."""

    def __init__(self, base_url: str, *, api_key: str = "", timeout: float = 15.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport,
                                      limits=httpx.Limits(max_connections=32, max_keepalive_connections=16))

    async def close(self) -> None:
        await self.http.aclose()

    def headers(self, browser_key: str | None) -> dict[str, str]:
        key = self.api_key or browser_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def get_raw(self, path: str, params: dict[str, str] | None = None, *,
                      browser_key: str | None = None) -> bytes:
        """The JSON body of a 2xx answer, as sent; an ``ArenaError`` otherwise."""
        try:
            resp = await self.http.get(path, params=params or None, headers=self.headers(browser_key))
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"the trajectory API did not answer {path} in time") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"the trajectory API at {self.base_url} is unreachable: {type(exc).__name__}") from None
        if resp.status_code < 400:
            if not resp.headers.get("content-type", "").startswith("application/json"):
                raise UpstreamError(f"the trajectory API answered {path} with {resp.headers.get('content-type')!r}, "
                                    "not JSON")
            return resp.content
        try:
            err = msgspec.json.decode(resp.content)["error"]
            code, message = str(err["code"]), str(err["message"])
        except Exception:  # noqa: BLE001 - not Arena's error shape (a proxy's page, a crash)
            code, message = "upstream_error", f"HTTP {resp.status_code} from the trajectory API"
        if resp.status_code == 404 and code != "not_found":
            message = f"the trajectory API has no route {path} (is it older than this dashboard?)"
        status = resp.status_code if resp.status_code in (400, 401, 403, 404, 409, 422, 429, 503) else 502
        if status == 502:
            log.warning("trajectory API %s: %s %s", path, resp.status_code, message)
        raise UpstreamAnswer(status, code, message)

    async def get(self, path: str, params: dict[str, str] | None = None, *, browser_key: str | None = None):
        return msgspec.json.decode(await self.get_raw(path, params, browser_key=browser_key))

    async def healthy(self) -> str | None:
        """None when the trajectory API answers ``/healthz``; else what is wrong."""
        try:
            resp = await self.http.get("/healthz", timeout=2.0)
        except httpx.HTTPError as exc:
            return f"trajectory API unreachable: {type(exc).__name__}"
        return None if resp.status_code == 200 else f"trajectory API /healthz answered {resp.status_code}"
