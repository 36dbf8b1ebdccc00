"""``CorkedTransport`` over a real socket pair: what one loop turn writes leaves in one
``send``, a large write leaves at once, closing delivers what is pending, aborting drops it."""

from __future__ import annotations

import asyncio
import socket

from arena_core.runtime import CorkedTransport


async def _pair(limit: int = 1 << 16) -> tuple[CorkedTransport, socket.socket]:
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    return CorkedTransport(transport, loop, limit=limit), peer


def _received(peer: socket.socket) -> bytes:
    try:
        return peer.recv(1 << 20)
    except BlockingIOError:
        return b""


async def test_writes_of_one_turn_leave_together_at_the_next():
    corked, peer = await _pair()
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    corked.write(b"body")
    assert corked.get_write_buffer_size() == 23
    await asyncio.sleep(0.01)  # the pending bytes are not sent before the loop turns...
    assert _received(peer) == b"HTTP/1.1 200 OK\r\n\r\nbody"  # ...and then in one piece, in order
    corked.write(b"next")
    assert _received(peer) == b""
    await asyncio.sleep(0.01)
    assert _received(peer) == b"next"
    corked.close()
    peer.close()


async def test_a_write_past_the_limit_leaves_at_once():
    corked, peer = await _pair(limit=1024)
    corked.write(b"a" * 100)
    corked.write(b"b" * 1000)  # 1,100 bytes pending: past the limit, sent without waiting for the loop
    got = _received(peer)
    assert got == b"a" * 100 + b"b" * 1000 and corked.get_write_buffer_size() == 0
    corked.close()
    peer.close()


async def test_close_delivers_what_is_pending_and_abort_drops_it():
    corked, peer = await _pair()
    corked.write(b"last words")
    corked.close()
    await asyncio.sleep(0.01)
    assert _received(peer) == b"last words"
    peer.settimeout(5)
    assert peer.recv(16) == b""  # then the end of the stream (a timeout here would raise)
    peer.close()
    corked, peer = await _pair()
    corked.write(b"never sent")
    corked.abort()
    await asyncio.sleep(0.01)
    peer.settimeout(5)
    try:
        assert peer.recv(16) == b""  # the connection ends without the pending bytes
    except ConnectionResetError:
        pass
    peer.close()


async def test_write_now_sends_what_is_pending_and_its_own_bytes_in_one_piece_at_once():
    corked, peer = await _pair()
    corked.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    corked.write_now(b"HTTP/1.1 200 OK\r\n\r\n")  # no loop turn needed
    assert _received(peer) == b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n"
    corked.write_now(b"alone")
    assert _received(peer) == b"alone" and corked.get_write_buffer_size() == 0
    corked.close()
    peer.close()
