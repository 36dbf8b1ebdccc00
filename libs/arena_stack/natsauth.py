"""NATS users per service, each allowed only the subjects its job needs: a sandbox worker
cannot publish verification results, a verification worker cannot publish sandbox outcomes,
a trainer can read the trajectory stream and nothing more. docs/deploy.md ("Authentication").

``authorization_block`` renders nats-server's configuration; ``with_user`` puts a user's
credentials into a NATS URL (what each service is given as ``ARENA_NATS_URL``);
``load_or_create`` keeps the embedded stack's passwords in ``<data_dir>/nats-users.json`` (0600).
``python -m arena_stack.natsauth env`` prints fresh passwords as compose's ``.env`` lines.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from arena_core import subjects

#: What every service does on JetStream: its API (streams, consumers, KV and object-store
#: reads), acks, flow control, request replies, and dead letters.
_JETSTREAM = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "_INBOX.>", "arena.dead.>"]
_KV = "$KV.{}.>"
_OBJECTS = f"$O.{subjects.OBJECT_ARTIFACTS}.>"

#: service -> (may publish, may subscribe). Replies come on ``_INBOX.>``.
PERMISSIONS: dict[str, tuple[list[str], list[str]]] = {
    "rollout": ([*_JETSTREAM, "arena.rollout.>", "arena.sandbox.run.>", "arena.step.>", subjects.STEP_PACKS,
                 "arena.verify.run",
                 "arena.env.>", _KV.format(subjects.KV_ROLLOUTS), _KV.format(subjects.KV_BACKENDS),
                 _KV.format(subjects.KV_VERIFIERS), _KV.format(subjects.KV_API_KEYS),
                 _KV.format(subjects.KV_ENVIRONMENTS), _OBJECTS],
                ["_INBOX.>", "arena.rollout.state.>"]),
    #: a multi-step task's step gate: it asks verification (arena.verify.step.*), the answer on _INBOX
    "sandbox": ([*_JETSTREAM, "arena.sandbox.started.>", "arena.sandbox.done.>", "arena.verify.run",
                 "arena.verify.step.>", _KV.format(subjects.KV_WORKERS), _OBJECTS],
                ["_INBOX.>", "arena.rollout.state.>", "arena.env.>"]),
    #: a rollout's state events: a verification the rollout no longer wants (it ended) is abandoned
    #: step gates in (arena.verify.step.*, answered on the asker's _INBOX), their grades kept for the final one
    "verification": ([*_JETSTREAM, "arena.verify.done.>", _KV.format(subjects.KV_STEP_GRADES), _OBJECTS],
                     ["_INBOX.>", "arena.rollout.state.>", "arena.verify.step.>"]),
    "trajectory": ([*_JETSTREAM, "arena.trajectory.>", "arena.group.>", "arena.trainer.metrics.>",
                    "arena.duel.done.>", _KV.format(subjects.KV_API_KEYS), _OBJECTS],
                   ["_INBOX.>"]),
    #: the web dashboard: live events in, the API keys' bucket read (JetStream API), nothing out
    "dashboard": (["$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "_INBOX.>"],
                  ["_INBOX.>", "arena.rollout.state.>", "arena.trainer.metrics.>", "arena.duel.done.>"]),
    #: a trainer (``arena.stream.TrajectoryStream``) and a policy server registering itself
    "trainer": ([*_JETSTREAM, _KV.format(subjects.KV_BACKENDS)], ["_INBOX.>", "arena.trainer.metrics.>"]),
    #: people and tools: ``arena keys``, ``arena backend``, the embedded stack's own checks
    "admin": ([">"], [">"]),
}




def _private_bucket(bucket: str) -> list[str]:
    """The JetStream API requests that read or destroy bucket ``bucket``'s entries (``$JS.API.>``,
    which every service needs for its own streams, allows them otherwise)."""
    stream = f"KV_{bucket}"
    return [f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>", f"$JS.API.STREAM.PURGE.{stream}",
            f"$JS.API.STREAM.DELETE.{stream}", f"$JS.API.STREAM.MSG.DELETE.{stream}"]


_VERIFIERS = _private_bucket(subjects.KV_VERIFIERS)  # the hidden tests: rollout writes, verification reads
_API_KEYS = _private_bucket(subjects.KV_API_KEYS)  # the keys' hashes: the APIs and the dashboard follow them
_STEP_GRADES = _private_bucket(subjects.KV_STEP_GRADES)  # hidden tests' output: verification's own
#: service -> what it may not publish although ``PERMISSIONS`` allows it (nats-server applies deny over allow)
DENIED: dict[str, list[str]] = {
    "sandbox": [*_VERIFIERS, *_API_KEYS, *_STEP_GRADES],
    "verification": _API_KEYS,
    "trajectory": [*_VERIFIERS, *_STEP_GRADES],
    "dashboard": [*_VERIFIERS, *_STEP_GRADES],
    "trainer": [*_VERIFIERS, *_API_KEYS, *_STEP_GRADES],
}

#: the user nats-servers of one cluster authenticate their routes with (not a client user)
ROUTE_USER = "route"
#: the embedded stack's passwords, under its data directory
CREDENTIALS_FILE = "nats-users.json"


def new_password() -> str:
    """A random password that starts with a letter: nats-server parses the value of a variable
    reference (``password: $ARENA_NATS_ROLLOUT_PASSWORD``, compose and Kubernetes) as a token,
    and one starting with a digit as a number ("Expected a digit but got 'i'"): it refuses to start."""
    return secrets.choice(string.ascii_letters) + secrets.token_urlsafe(18)


def passwords() -> dict[str, str]:
    """A fresh password per user, and one for a cluster's routes (``ROUTE_USER``)."""
    return {user: new_password() for user in [*PERMISSIONS, ROUTE_USER]}


def load_or_create(path: Path) -> dict[str, str]:
    """The passwords kept in ``path`` (user -> password, JSON, mode 0600), so that a restart
    and workers started elsewhere with them keep working; fresh ones, written there, when
    the file is absent (and for a user it does not name yet)."""
    known: dict[str, str] = {}
    if path.exists():
        known = json.loads(path.read_text())
        if not isinstance(known, dict) or not all(isinstance(v, str) and v for v in known.values()):
            raise ValueError(f"{path} is not a JSON object of user -> password")
    wanted = {**passwords(), **known}
    if wanted != known or path.stat().st_mode & 0o077:
        write_private(path, json.dumps(wanted, indent=1) + "\n")
    return wanted


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable and writable by this user only (0600), never wider
    even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def env_name(user: str) -> str:
    """The environment variable that carries ``user``'s password in compose and Kubernetes."""
    return f"ARENA_NATS_{user.upper()}_PASSWORD"


def authorization_block(passwords: dict[str, str] | None = None, *, from_env: bool = False) -> str:
    """nats-server's ``authorization { users = [...] }`` for ``passwords`` (JSON strings are
    valid NATS configuration values); with ``from_env``, each password is a reference to
    ``env_name(user)``, which nats-server reads from its environment (compose's configuration)."""
    if not from_env and passwords is None:
        raise ValueError("authorization_block needs the passwords, or from_env")
    users = []
    for user, (publish, subscribe) in PERMISSIONS.items():
        password = f"${env_name(user)}" if from_env else json.dumps(passwords[user])
        deny = f", deny: {json.dumps(DENIED[user])}" if user in DENIED else ""
        users.append(f"    {{user: {json.dumps(user)}, password: {password}, permissions: "
                     f"{{publish: {{allow: {json.dumps(publish)}{deny}}}, subscribe: {{allow: {json.dumps(subscribe)}}}}}}}")
    return "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n}\n"


def with_user(url: str, user: str, password: str) -> str:
    """``url`` (one or several, comma-separated) with ``user``'s credentials in each."""
    out = []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        host = parts.hostname or "127.0.0.1"
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
        out.append(urlunsplit((parts.scheme or "nats", netloc, parts.path, parts.query, parts.fragment)))
    return ",".join(out)


def main(argv: list[str]) -> int:
    """``env``: fresh passwords as ``ARENA_NATS_<USER>_PASSWORD=...`` lines (compose's ``.env``);
    ``conf``: the authorization block reading them (deploy/images/nats/nats-server.conf)."""
    if argv == ["env"]:
        print("\n".join(f"{env_name(user)}={pw}" for user, pw in passwords().items() if user in PERMISSIONS))
    elif argv == ["conf"]:
        print(authorization_block(from_env=True), end="")
    else:
        print("usage: python -m arena_stack.natsauth env|conf", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
