"""NATS users per service, each allowed only the subjects its job needs: a sandbox worker
cannot publish verification results, a verification worker cannot publish sandbox outcomes,
a trainer can read the trajectory stream and nothing more. docs/deploy.md ("Authentication").

``authorization_block`` renders nats-server's configuration; ``with_user`` puts a user's
credentials into a NATS URL (what each service is given as ``ARENA_NATS_URL``).
"""

from __future__ import annotations

import json
import secrets
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
    "sandbox": ([*_JETSTREAM, "arena.sandbox.started.>", "arena.sandbox.done.>", "arena.verify.run",
                 _KV.format(subjects.KV_WORKERS), _OBJECTS],
                ["_INBOX.>", "arena.rollout.state.>", "arena.env.>"]),
    "verification": ([*_JETSTREAM, "arena.verify.done.>", _OBJECTS], ["_INBOX.>"]),
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


def passwords() -> dict[str, str]:
    """A fresh password per user."""
    return {user: secrets.token_urlsafe(18) for user in PERMISSIONS}


def authorization_block(passwords: dict[str, str]) -> str:
    """nats-server's ``authorization { users = [...] }`` for ``passwords`` (JSON strings are
    valid NATS configuration values)."""
    users = []
    for user, (publish, subscribe) in PERMISSIONS.items():
        users.append(f"    {{user: {json.dumps(user)}, password: {json.dumps(passwords[user])}, permissions: "
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
