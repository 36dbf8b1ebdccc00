"""A service under ``arena_core.runtime`` (uvicorn serving an app, a consumer beside it, on
uvloop) stops cleanly on SIGTERM or SIGINT: the consumer sees the stop at once, the HTTP
server drains, the process exits 0. Run as a real process, signalled from outside."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from arena_stack.natsserver import free_port

SERVICE = textwrap.dedent("""
    import asyncio, sys, time
    from arena_core.runtime import run, serve, stop_on_signals

    class Consumer:
        async def run(self, stop):
            await stop.wait()
            print("consumer stopped", flush=True)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        stop = stop_on_signals()
        code = await serve(stop, consumers=[Consumer()], app=app, port=int(sys.argv[1]))
        print("served, code", code, flush=True)
        return code

    sys.exit(run(main()))
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_and_the_consumers_together_and_exits_0(sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVICE, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/", timeout=1).text == "ok"
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["consumer stopped", "served, code 0"]
