"""What the sandbox's LLM relay costs per call and per waiting connection: the filtering relay
(``arena_sandbox_providers.relay``, HTTP/1.1 parsed with h11, only the rollout's proxy routes)
against the plain TCP relay it replaced (``ProxyForward.routes=None``).

Three processes: a minimal HTTP/1.1 upstream (a whole JSON answer, or an SSE answer of
``--chunks`` events), the relay (the host side, as the sandbox service runs it: listening on a
Unix socket, the shim's end), and this client (keep-alive connections over the Unix socket).
Printed: the relay process's CPU per call (user + system), and its memory (RSS growth) per idle
kept-alive connection and per call waiting on the LLM (the state of most agents).

``.venv/bin/python benchmarks/sandbox_relay.py --calls 2000 --idle 500``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "/proxy/r-bench"


async def _upstream(port_file: str, chunks: int) -> None:
    whole = b'{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hello"}}]}'
    event = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                if b'"hang": true' in body:  # a call waiting on the LLM: never answered
                    await asyncio.Event().wait()
                if b'"stream": true' in body:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    for _ in range(chunks):
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                    done = b"data: [DONE]\n\n"
                    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(whole), whole))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()


async def _relay(port: int, path: str, filtering: bool) -> None:
    sys.path[:0] = [str(ROOT / "libs")]
    from arena_sandbox_providers import local

    proxy = local.ProxyForward("127.0.0.1", port, routes=PREFIX if filtering else None)
    forwarder = local._Forwarder(proxy, Path(path))
    await forwarder.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():  # "cpu" / "rss": the client asks
        if line.strip() == b"cpu":
            t = os.times()
            print(t.user + t.system, flush=True)
        else:
            with open("/proc/self/status") as fh:
                rss = next(int(x.split()[1]) for x in fh if x.startswith("VmRSS:"))
            print(rss, flush=True)


def _ask(proc: subprocess.Popen, what: str) -> float:
    proc.stdin.write(f"{what}\n".encode())
    proc.stdin.flush()
    return float(proc.stdout.readline())


def _call(sock: socket.socket, fp, stream: bool) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}).encode()
    sock.sendall(b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer k\r\ncontent-length: %d\r\n\r\n%s" % (PREFIX.encode(), len(body), body))
    length, chunked = 0, False
    while (line := fp.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
        chunked |= line.lower().startswith(b"transfer-encoding:")
    if not chunked:
        fp.read(length)
        return
    while True:
        size = int(fp.readline(), 16)
        fp.read(size + 2)
        if size == 0:
            return


def measure(filtering: bool, calls: int, idle: int, stream: bool, upstream_port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "proxy.sock")
        proc = subprocess.Popen([sys.executable, __file__, "--serve-relay", str(upstream_port), path,
                                 "1" if filtering else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            while not os.path.exists(path):
                time.sleep(0.01)
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(path)
            fp = sock.makefile("rb")
            for _ in range(50):
                _call(sock, fp, stream)  # warm up
            cpu0, t0 = _ask(proc, "cpu"), time.perf_counter()
            for _ in range(calls):
                _call(sock, fp, stream)
            wall, cpu = time.perf_counter() - t0, _ask(proc, "cpu") - cpu0
            sock.close()
            rss0 = _ask(proc, "rss")
            held = []
            for _ in range(idle):  # connections that made one call and now wait, kept alive
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                _call(s, s.makefile("rb"), False)
                held.append(s)
            time.sleep(0.5)
            rss = _ask(proc, "rss") - rss0
            hang = json.dumps({"model": "m", "messages": [], "hang": True}).encode()
            for s in held:  # each now waits on a call the LLM never answers
                s.sendall(b"POST %s/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                          % (PREFIX.encode(), len(hang), hang))
            time.sleep(1.0)
            waiting = _ask(proc, "rss") - rss0
            for s in held:
                s.close()
            return {"cpu_us_per_call": cpu / calls * 1e6, "wall_us_per_call": wall / calls * 1e6,
                    "kib_per_idle_connection": rss / idle if idle else 0.0,
                    "kib_per_waiting_call": waiting / idle if idle else 0.0}
        finally:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--idle", type=int, default=500)
    parser.add_argument("--chunks", type=int, default=100, help="SSE events per streamed answer")
    parser.add_argument("--serve-relay", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--serve-upstream", nargs=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_relay:
        port, path, filtering = args.serve_relay
        asyncio.run(_relay(int(port), path, filtering == "1"))
        return
    if args.serve_upstream:
        asyncio.run(_upstream(args.serve_upstream[0], args.chunks))
        return
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        upstream = subprocess.Popen([sys.executable, __file__, "--serve-upstream", port_file,
                                     "--chunks", str(args.chunks)])
        try:
            while not os.path.exists(port_file) or not Path(port_file).read_text():
                time.sleep(0.01)
            port = int(Path(port_file).read_text())
            print(f"load average {os.getloadavg()[0]:.2f}")
            for stream in (False, True):
                for filtering in (False, True):
                    row = measure(filtering, args.calls if not stream else args.calls // 4, args.idle, stream, port)
                    kind = "filtering (h11)" if filtering else "plain TCP"
                    answer = f"SSE, {args.chunks} events" if stream else "whole JSON"
                    print(f"{kind:16} {answer:16} relay CPU {row['cpu_us_per_call']:7.1f} us/call, "
                          f"round trip {row['wall_us_per_call']:7.1f} us, "
                          f"{row['kib_per_idle_connection']:5.1f} KiB per idle connection, "
                          f"{row['kib_per_waiting_call']:5.1f} KiB per call waiting on the LLM")
            print(f"load average {os.getloadavg()[0]:.2f}")
        finally:
            upstream.kill()
            upstream.wait()


if __name__ == "__main__":
    main()
