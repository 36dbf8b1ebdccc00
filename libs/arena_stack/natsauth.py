"""NATS users per service, each allowed only the subjects its job needs: a sandbox worker
cannot publish verification results, a verification worker cannot publish sandbox outcomes,
a trainer can read the trajectory stream and nothing more. On JetStream each may use only its
own streams, consumers, buckets and object store (``arena_core.access``): no service creates,
deletes or purges a stream (the topology step does, as ``admin``: ``arena_stack.topology``).
docs/deploy.md ("Authentication").

``authorization_block`` renders nats-server's configuration; ``with_user`` puts a user's
credentials into a NATS URL (what each service is given as ``ARENA_NATS_URL``);
``load_or_create`` keeps the embedded stack's passwords in ``<data_dir>/nats-users.json`` (0600).
``python -m arena_stack.natsauth env`` prints fresh passwords as compose's ``.env`` lines;
``write`` regenerates compose's nats-server.conf and the Helm values, ``check`` fails on drift.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from arena_core import access, subjects

#: What every service may publish besides its JetStream API requests (``arena_core.access``):
#: flow control of its ordered consumers, request replies.
_COMMON = ["$JS.FC.>", "_INBOX.>"]


def _jetstream(service: str) -> list[str]:
    """``service``'s JetStream API requests, acks, KV and object-store subjects: only its own
    streams, consumers, buckets and stores (``arena_core.access.SERVICES``); the dead letters of
    the streams it consumes (``arena.dead.<stream>``: none forged for another's); common subjects."""
    own = access.SERVICES[service]
    return [*access.api_subjects(own), *_COMMON, *(subjects.dead(stream) for stream in own.consumers)]


#: service -> (may publish, may subscribe). Replies come on ``_INBOX.>``. Nothing on ``$JS.API``
#: beyond what ``arena_core.access`` lists: no service creates, updates, deletes or purges a
#: stream (the topology is the admin's, ``arena_stack.topology``), nor touches another's
#: consumers, nor reads a bucket it has no use for (the verifiers' is verification's alone).
PERMISSIONS: dict[str, tuple[list[str], list[str]]] = {
    "rollout": ([*_jetstream("rollout"), "arena.rollout.>", "arena.sandbox.run.>", "arena.step.>",
                 subjects.STEP_PACKS, "arena.verify.run", "arena.env.>"],
                ["_INBOX.>", "arena.rollout.state.>"]),
    #: a multi-step task's step gate: it asks verification (arena.verify.step.*), the answer on _INBOX
    "sandbox": ([*_jetstream("sandbox"), "arena.sandbox.started.>", "arena.sandbox.done.>", "arena.verify.run",
                 "arena.verify.step.>"],
                ["_INBOX.>", "arena.rollout.state.>", "arena.env.>"]),
    #: a rollout's state events: a verification the rollout no longer wants (it ended) is abandoned
    #: step gates in (arena.verify.step.*, answered on the asker's _INBOX), their grades kept for the final one
    "verification": ([*_jetstream("verification"), "arena.verify.done.>"],
                     ["_INBOX.>", "arena.rollout.state.>", "arena.verify.step.>"]),
    "trajectory": ([*_jetstream("trajectory"), "arena.trajectory.>", "arena.group.>", "arena.trainer.metrics.>",
                    "arena.duel.done.>"],
                   ["_INBOX.>"]),
    #: the web dashboard: live events in, the API keys' bucket read (and a sign-in token's key
    #: purged when it is used), nothing out
    "dashboard": (_jetstream("dashboard"),
                  ["_INBOX.>", "arena.rollout.state.>", "arena.trainer.metrics.>", "arena.duel.done.>"]),
    #: a trainer (``arena.stream.TrajectoryStream``) and a policy server registering itself
    "trainer": (_jetstream("trainer"), ["_INBOX.>", "arena.trainer.metrics.>"]),
    #: people and tools: ``arena keys``, ``arena backend``, the topology step (``arena_stack.topology``:
    #: it alone creates streams, buckets and stores), the embedded stack's own checks
    "admin": ([">"], [">"]),
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
        users.append(f"    {{user: {json.dumps(user)}, password: {password}, permissions: "
                     f"{{publish: {{allow: {json.dumps(publish)}}}, subscribe: {{allow: {json.dumps(subscribe)}}}}}}}")
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


ROOT = Path(__file__).resolve().parents[2]
#: compose's nats-server configuration and the NATS Helm chart's values, whose users this renders
COMPOSE_CONF = ROOT / "deploy" / "images" / "nats" / "nats-server.conf"
HELM_VALUES = ROOT / "deploy" / "k8s" / "nats" / "values.yaml"
_HELM_USERS = "      users:\n"


def helm_users() -> str:
    """The NATS Helm chart's ``config.merge.authorization.users`` (deploy/k8s/nats/values.yaml):
    natsauth's users, each password read from nats-server's environment (``env_name``)."""
    lines = [_HELM_USERS]
    for user, (publish, subscribe) in PERMISSIONS.items():
        lines += [f"        - user: {user}\n", f"          password: << ${env_name(user)} >>\n",
                  "          permissions:\n", f"            publish: {json.dumps({'allow': publish})}\n",
                  f"            subscribe: {json.dumps({'allow': subscribe})}\n"]
    return "".join(lines)


def rendered() -> dict[Path, str]:
    """Each generated file as it should be: the authorization block in compose's configuration,
    the users in the Helm values (the rest of each file is kept as it is)."""
    conf = COMPOSE_CONF.read_text()
    start = conf.index("authorization {\n")
    end = conf.index("\n}\n", start) + 3
    values = HELM_VALUES.read_text()
    first = values.index(_HELM_USERS)
    last = values.index("\ncontainer:\n", first) + 1
    return {COMPOSE_CONF: conf[:start] + authorization_block(from_env=True) + conf[end:],
            HELM_VALUES: values[:first] + helm_users() + values[last:]}


def main(argv: list[str]) -> int:
    """``env``: fresh passwords as ``ARENA_NATS_<USER>_PASSWORD=...`` lines (compose's ``.env``);
    ``conf``: the authorization block reading them (deploy/images/nats/nats-server.conf);
    ``write``: that block into compose's configuration and the users into the Helm values;
    ``check``: exit 1 if either differs from what ``write`` would make."""
    if argv == ["env"]:
        print("\n".join(f"{env_name(user)}={pw}" for user, pw in passwords().items() if user in PERMISSIONS))
    elif argv == ["conf"]:
        print(authorization_block(from_env=True), end="")
    elif argv in (["write"], ["check"]):
        stale = [path for path, text in rendered().items() if path.read_text() != text]
        if argv == ["write"]:
            for path in stale:
                path.write_text(rendered()[path])
        for path in stale:
            print(f"{path.relative_to(ROOT)}: {'rewritten' if argv == ['write'] else 'out of date: python -m arena_stack.natsauth write'}",
                  file=sys.stderr)
        return 1 if stale and argv == ["check"] else 0
    else:
        print("usage: python -m arena_stack.natsauth env|conf|write|check", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
