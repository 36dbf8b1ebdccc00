"""What each service does on JetStream: the streams it publishes to, the durable consumers it
owns, the streams it reads by subject, the KV buckets it reads or writes, the object stores it
uses. One table, two uses: ``arena_stack.natsauth`` renders each service's NATS permissions
from it (nothing else on ``$JS.API``), and ``Bus.bind_topology`` checks at a service's start
that its streams exist (the topology is created by a privileged step: ``arena up``, compose's
``topology`` service, Kubernetes' ``arena-topology`` Job; ``python -m arena_stack.topology``).
docs/security.md ("The bus").
"""

from __future__ import annotations

import msgspec

from arena_core import subjects

#: A consumer name that stands for any (one subject token): a sandbox worker's consumer is
#: ``sandbox-{provider}``, a trainer's ``trainer-{name}``.
ANY = "*"


class JetStreamAccess(msgspec.Struct, frozen=True, kw_only=True):
    #: streams it publishes into (and binds to at start)
    publishes: tuple[str, ...] = ()
    #: stream -> the durable consumers it creates, reads and deletes there (``ANY``: any name)
    consumers: dict[str, tuple[str, ...]] = {}
    #: streams whose messages it reads by subject (``get_last_msg``, ``get_msg``)
    gets: tuple[str, ...] = ()
    #: KV buckets it reads (get, keys, watch)
    kv_reads: tuple[str, ...] = ()
    #: KV buckets it writes (put, create, delete)
    kv_writes: tuple[str, ...] = ()
    #: KV buckets whose keys it purges (a sign-in token is used by purging its key)
    kv_purges: tuple[str, ...] = ()
    #: object stores it reads and writes
    objects: tuple[str, ...] = ()

    def streams(self) -> list[str]:
        """Every stream it needs to exist (buckets' and stores' included), in a stable order."""
        named = [*self.publishes, *self.consumers, *self.gets,
                 *(f"KV_{b}" for b in (*self.kv_reads, *self.kv_writes, *self.kv_purges)),
                 *(f"OBJ_{o}" for o in self.objects)]
        return list(dict.fromkeys(named))


_DEAD = "ARENA_DEAD"
_ARTIFACTS = (subjects.OBJECT_ARTIFACTS,)
_PRIVATE = (subjects.OBJECT_ARTIFACTS, subjects.OBJECT_PRIVATE)  # large verifiers: rollout writes, verification reads

SERVICES: dict[str, JetStreamAccess] = {
    "rollout": JetStreamAccess(
        publishes=("ARENA_ROLLOUTS", "ARENA_SANDBOX_JOBS", "ARENA_STEPS", "ARENA_VERIFY_JOBS", _DEAD),
        consumers={"ARENA_RESULTS": tuple(f"{subjects.CONSUMER_ROLLOUT_RESULTS}-{kind}"
                                          for kind in ("started", "sandbox", "verify")),
                   _DEAD: (f"{subjects.CONSUMER_ROLLOUT_RESULTS}-dead",)},
        kv_reads=(subjects.KV_ROLLOUTS, subjects.KV_BACKENDS, subjects.KV_API_KEYS, subjects.KV_ENVIRONMENTS,
                  subjects.KV_WORKERS),
        kv_writes=(subjects.KV_ROLLOUTS, subjects.KV_BACKENDS, subjects.KV_VERIFIERS, subjects.KV_API_KEYS,
                   subjects.KV_ENVIRONMENTS),
        objects=_PRIVATE),
    "sandbox": JetStreamAccess(
        publishes=("ARENA_RESULTS", "ARENA_VERIFY_JOBS", _DEAD),
        consumers={"ARENA_SANDBOX_JOBS": (ANY,)},  # sandbox-{provider}
        kv_reads=(subjects.KV_ROLLOUTS, subjects.KV_WORKERS),
        kv_writes=(subjects.KV_WORKERS,),
        objects=_ARTIFACTS),
    "verification": JetStreamAccess(
        publishes=("ARENA_RESULTS", _DEAD),
        consumers={"ARENA_VERIFY_JOBS": (subjects.CONSUMER_VERIFIER,)},
        gets=("ARENA_RESULTS",),  # a rollout's sandbox outcome
        kv_reads=(subjects.KV_VERIFIERS, subjects.KV_STEP_GRADES),
        kv_writes=(subjects.KV_STEP_GRADES,),
        objects=_PRIVATE),
    "trajectory": JetStreamAccess(
        publishes=("ARENA_TRAJECTORIES", _DEAD),
        consumers={"ARENA_STEPS": (subjects.CONSUMER_TRAJ_STEPS,),
                   "ARENA_RESULTS": (subjects.CONSUMER_TRAJ_RESULTS,),
                   "ARENA_ROLLOUTS": (subjects.CONSUMER_TRAJ_STATES,)},
        gets=("ARENA_TRAJECTORIES",),
        kv_reads=(subjects.KV_API_KEYS,),
        kv_writes=(subjects.KV_API_KEYS,),
        objects=_ARTIFACTS),
    "dashboard": JetStreamAccess(
        kv_reads=(subjects.KV_API_KEYS,),
        kv_purges=(subjects.KV_API_KEYS,)),
    #: ``arena.stream.TrajectoryStream`` (its consumer ``trainer-{name}``) and a policy server
    "trainer": JetStreamAccess(
        consumers={"ARENA_TRAJECTORIES": (ANY,)},
        gets=("ARENA_TRAJECTORIES",),
        kv_reads=(subjects.KV_BACKENDS,),
        kv_writes=(subjects.KV_BACKENDS,)),
}


def api_subjects(access: JetStreamAccess) -> list[str]:
    """The ``$JS.API`` requests and JetStream subjects ``access`` needs to publish, nothing else:
    no stream is created, updated, deleted or purged (but its own KV keys' and objects'
    subjects), no one else's consumer is touched."""
    api = "$JS.API"
    out = [f"{api}.INFO", f"{api}.STREAM.NAMES"]  # account limits; which stream takes a subject
    out += [f"{api}.STREAM.INFO.{s}" for s in access.streams()]
    for stream, names in access.consumers.items():
        for name in names:
            out += [f"{api}.CONSUMER.CREATE.{stream}.{name}", f"{api}.CONSUMER.CREATE.{stream}.{name}.>",
                    f"{api}.CONSUMER.DURABLE.CREATE.{stream}.{name}", f"{api}.CONSUMER.INFO.{stream}.{name}",
                    f"{api}.CONSUMER.MSG.NEXT.{stream}.{name}", f"{api}.CONSUMER.DELETE.{stream}.{name}"]
        out.append(f"$JS.ACK.{stream}.>")
    readable = [*(f"KV_{b}" for b in access.kv_reads), *(f"OBJ_{o}" for o in access.objects)]
    for stream in [*access.gets, *readable]:
        out += [f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>", f"{api}.STREAM.MSG.GET.{stream}"]
    for stream in readable:  # watches, key listings, object reads: ordered (ephemeral) consumers
        out += [f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
                f"{api}.CONSUMER.INFO.{stream}.*", f"{api}.CONSUMER.DELETE.{stream}.*"]
    out += [f"$KV.{b}.>" for b in access.kv_writes]
    out += [f"{api}.STREAM.PURGE.KV_{b}" for b in access.kv_purges]
    for store in access.objects:  # a put replaces (purges) an object's old chunks; a delete purges its own
        out += [f"$O.{store}.>", f"{api}.STREAM.PURGE.OBJ_{store}"]
    return list(dict.fromkeys(out))
