"""compose's NATS lets in only Arena's users: deploy/images/nats/nats-server.conf holds
natsauth's users (passwords from nats-server's environment), compose.yaml requires every
password and gives each service its own user, and nats-server, started on that very file,
refuses a client without credentials or with a wrong password. No containers run here
(tests/deploy/test_compose.py runs the stack for real)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import nats
import pytest
import yaml

from arena_stack import natsauth
from arena_stack.natsserver import binary, free_port, js_api_info, wait_port

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "images" / "nats" / "nats-server.conf"
#: the compose services that use NATS, each as the user of its name
SERVICES = ("rollout", "trajectory", "sandbox", "verification", "dashboard")


def test_the_configuration_holds_natsauths_users_with_passwords_from_the_environment():
    assert natsauth.authorization_block(from_env=True) in CONF.read_text()


def test_generated_passwords_start_with_a_letter_so_nats_server_reads_them_as_strings():
    # nats-server parses a variable reference's value as a token: one starting with a digit as a
    # number ("Expected a digit but got 'i'"), and refuses to start (a 1-in-6 chance per password)
    drawn = [pw for _ in range(300) for pw in natsauth.passwords().values()]
    assert all(pw[0].isascii() and pw[0].isalpha() and len(pw) >= 24 for pw in drawn)
    assert len(set(drawn)) == len(drawn)


def test_compose_requires_every_password_and_gives_each_service_its_own_user():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    nats_env = compose["services"]["nats"]["environment"]
    for user in natsauth.PERMISSIONS:
        variable = natsauth.env_name(user)
        assert re.fullmatch(rf"\$\{{{variable}:\?[^}}]+\}}", nats_env[variable]), "required, not defaulted"
    for service in SERVICES:
        url = compose["services"][service]["environment"]["ARENA_NATS_URL"]
        assert re.fullmatch(rf"nats://{service}:\$\{{{natsauth.env_name(service)}:\?[^}}]+\}}@nats:4222", url), url


@pytest.fixture
def compose_nats(tmp_path):
    """nats-server on deploy/images/nats/nats-server.conf (its port and store moved here), with
    the passwords in its environment as compose gives them; (port, passwords)."""
    passwords = {user: pw for user, pw in natsauth.passwords().items() if user in natsauth.PERMISSIONS}
    env = {natsauth.env_name(user): pw for user, pw in passwords.items()}
    for attempt in range(3):  # a free port can be taken by another process before nats-server binds it
        port = free_port()
        text = (CONF.read_text().replace("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{port}")
                .replace("http: 0.0.0.0:8222\n", "").replace('store_dir: "/data"', f'store_dir: "{tmp_path / "js"}"'))
        assert f"127.0.0.1:{port}" in text and "http: " not in text and str(tmp_path) in text
        conf = tmp_path / "nats-server.conf"
        conf.write_text(text)
        with open(tmp_path / "nats.log", "wb") as log:
            proc = subprocess.Popen([binary(), "-c", str(conf)], env=env, stdout=log, stderr=log)
        try:
            wait_port("127.0.0.1", port, 15, proc)
            break
        except RuntimeError:
            if attempt == 2:
                raise AssertionError((tmp_path / "nats.log").read_text()[-2000:]) from None
    try:
        yield port, passwords
    finally:
        proc.terminate()
        proc.wait(10)


async def test_nats_on_that_configuration_refuses_clients_without_their_password(compose_nats):
    port, passwords = compose_nats
    url = f"nats://127.0.0.1:{port}"
    assert js_api_info(port) is None  # no credentials: refused
    assert js_api_info(port, credentials=("rollout", "not-its-password")) is None
    assert js_api_info(port, credentials=("rollout", passwords["sandbox"])) is None  # another user's
    assert js_api_info(port, credentials=("rollout", passwords["rollout"])) is not None
    with pytest.raises(Exception, match="(?i)authorization"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
    nc = await nats.connect(natsauth.with_user(url, "sandbox", passwords["sandbox"]), allow_reconnect=False)
    await nc.close()
