"""Fixtures of the stack tests: a real nats-server with the services' NATS users as natsauth renders them."""

from __future__ import annotations

import pytest

from arena_stack import natsauth
from arena_stack.natsserver import NatsServer


@pytest.fixture
def server(tmp_path):
    """A nats-server (temp dir, free port) whose users are every service's: (server, passwords)."""
    secrets = natsauth.passwords()
    srv = NatsServer(tmp_path / "nats", sync="1s", extra_config=natsauth.authorization_block(secrets)).start()
    try:
        yield srv, secrets
    finally:
        srv.stop()
