"""A bare pass-through proxy from the libraries Arena's proxy is built on: the floor.

It forwards ``POST /v1/chat/completions`` to the backend with aiohttp's client and relays
the answer (whole or streamed), with nothing else: no key, no budget, no capture. Served by
uvicorn (httptools, uvloop) or by aiohttp.web; ``proxy_overhead.py`` measures it beside
Arena's proxy, so what Arena adds over the libraries shows apart from what they cost.

Run: ``python benchmarks/passthrough_proxy.py {uvicorn|aiohttp} PORT BACKEND_URL``
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import uvloop

_JSON = "application/json"


class Forward:
    def __init__(self, backend_url: str) -> None:
        self.url = backend_url.rstrip("/") + "/chat/completions"
        self.session: aiohttp.ClientSession | None = None

    def post(self, body: bytes):
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        return self.session.post(self.url, data=body, headers={"content-type": _JSON})


def asgi_app(forward: Forward):
    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # readiness
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        async with forward.post(body) as resp:
            if b'"stream":true' in body.replace(b" ", b""):
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [(b"content-type", b"text/event-stream")]})
                async for piece in resp.content.iter_any():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            data = await resp.read()
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": [(b"content-type", _JSON.encode()), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


async def serve_uvicorn(forward: Forward, port: int) -> None:
    import uvicorn

    config = uvicorn.Config(asgi_app(forward), host="127.0.0.1", port=port, loop="none", http="httptools",
                            lifespan="off", log_level="warning", access_log=False)
    await uvicorn.Server(config).serve()


async def serve_aiohttp(forward: Forward, port: int) -> None:
    from aiohttp import web

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "GET":  # readiness
            return web.Response()
        body = await request.read()
        async with forward.post(body) as resp:
            if b'"stream":true' in body.replace(b" ", b""):
                out = web.StreamResponse(status=resp.status, headers={"content-type": "text/event-stream"})
                await out.prepare(request)
                async for piece in resp.content.iter_any():
                    await out.write(piece)
                await out.write_eof()
                return out
            return web.Response(status=resp.status, body=await resp.read(), content_type=_JSON)

    runner = web.ServerRunner(web.Server(handle), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def main() -> None:
    server, port, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    serve = {"uvicorn": serve_uvicorn, "aiohttp": serve_aiohttp}[server]
    uvloop.run(serve(Forward(backend), port))


if __name__ == "__main__":
    main()
