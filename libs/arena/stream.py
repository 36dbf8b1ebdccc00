"""The trainer's end of Arena: ``TrajectoryStream`` yields completed groups from
``ARENA_TRAJECTORIES``, acknowledged only when the trainer commits them.

A restarted trainer resumes where it left off. See docs/trajectory.md ("The trainer stream").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Literal, NamedTuple

import msgspec
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError, StaleConnectionError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from arena_core.bus import BodyMissing, Bus, redact
from arena_core.errors import Unavailable
from arena_core.schemas import GroupCompleted, MemberRef, TrainingSequence, Trajectory
from arena_core.sequences import ensure_sequences, lacks_sequences, sequences_of

log = logging.getLogger("arena.stream")

STREAM = "ARENA_TRAJECTORIES"
GROUP_SUBJECTS = "arena.group.*"

_decoder = msgspec.json.Decoder(GroupCompleted)
_trajectory_decoder = msgspec.json.Decoder(Trajectory)
#: Deliveries of a group whose member trajectory is not on the stream before it is dropped
#: (the service publishes members before their group: one missing that long was removed).
MEMBER_WAIT_DELIVERIES = 60


class StreamStats(msgspec.Struct, kw_only=True):
    """Counters of one ``TrajectoryStream`` session."""

    received: int = 0  # messages fetched, redeliveries included
    yielded: int = 0  # groups handed to the trainer
    committed: int = 0  # groups acknowledged by ``commit()``
    dropped_stale: int = 0  # groups acked unseen: older than ``max_staleness``
    duplicates: int = 0  # a group already yielded in this session, delivered again
    dropped_partial: int = 0  # partial groups (timed out without every member) acked unseen
    undecodable: int = 0  # messages that are not a ``GroupCompleted`` (terminated)
    missing_members: int = 0  # groups terminated because a member's trajectory never was on the stream
    other_project: int = 0  # groups of another project than ``project`` acked unseen


def _decode(data: bytes) -> GroupCompleted:
    """A group message, each member it carries with its training sequences assembled from its
    steps: they are derived data, not on the wire (docs/trajectory.md, "Training sequences").
    Assembling them costs less than decoding them would (as many token ids again)."""
    group = _decoder.decode(data)
    if any(lacks_sequences(t) for t in group.trajectories):
        group = msgspec.structs.replace(group, trajectories=[ensure_sequences(t) for t in group.trajectories])
    return group


def _decode_trajectory(data: bytes) -> Trajectory:
    """A member's trajectory message, with its training sequences assembled (as ``_decode``)."""
    return ensure_sequences(_trajectory_decoder.decode(data))


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic GC off inside. Decoded groups are tens of thousands of fresh containers
    (token ids, logprobs) without cycles; a collection while they are made scans them again
    and again (a trainer reading 800-byte steps spent 20 us a step, 11 of them in the GC,
    until its reads of a fetched batch ran with it paused: 11.9). It runs again right after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                # what was made inside goes straight to the oldest generation (two list splices):
                # the first collection after the pause would otherwise scan all of it, alive,
                # only to promote it; freed by reference counting, it is never scanned at all
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class SequenceSample(NamedTuple):
    """One training sequence of a group member, with the member's group advantage."""

    rollout_id: str
    sequence: TrainingSequence
    advantage: float


def training_sequences(group: GroupCompleted) -> list[SequenceSample]:
    """Every member's training sequences (``Trajectory.sequences``: token ids, loss mask,
    sampling logprobs) with its advantage, members in ``group_index`` order, ready for a
    token-level loss. Members without a reward (``excluded_indexes``) are left out."""
    excluded = set(group.excluded_indexes)
    out = []
    for t, advantage in zip(group.trajectories, group.advantages):
        if t.reward is None or t.group_index in excluded:
            continue
        out += [SequenceSample(t.rollout_id, seq, advantage) for seq in sequences_of(t)[0]]
    return out


def group_policy_version(group: GroupCompleted) -> int | None:
    """The oldest policy version (as an int) that produced any step of ``group``;
    ``None`` if no version parses as an int."""
    versions = []
    for trajectory in group.trajectories:
        for version in trajectory.policy_versions:
            try:
                versions.append(int(version))
            except ValueError:
                continue
    return min(versions) if versions else None


def is_stale(group: GroupCompleted, current: int | str | None, max_staleness: int | None) -> bool:
    """Whether ``group`` is more than ``max_staleness`` versions behind ``current``.

    Versions that do not parse as ints are never stale: staleness is then unknown.
    """
    if max_staleness is None or current is None:
        return False
    try:
        now = int(current)
    except ValueError:
        return False
    oldest = group_policy_version(group)
    return oldest is not None and now - oldest > max_staleness


class GroupBatch:
    """Groups handed to the trainer together; acknowledged only by ``commit()``."""

    def __init__(self, stream: TrajectoryStream, groups: list[GroupCompleted], seqs: list[int]):
        self._stream = stream
        self.groups = groups
        self._seqs = seqs
        self.committed = False

    def __iter__(self) -> Iterator[GroupCompleted]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    async def commit(self) -> None:
        """Acknowledge every group of the batch and wait until the server has the acks.
        Idempotent. If it raises, the uncommitted groups will be delivered again."""
        if self.committed:
            return
        await self._stream._commit(self._seqs)  # noqa: SLF001 - the batch belongs to its stream
        self.committed = True


class TrajectoryStream:
    """Completed groups for a trainer, from a durable consumer ``trainer-{name}``.

    ``max_staleness`` with ``current_policy_version`` drops (acks without yielding, and
    counts in ``stats.dropped_stale``) groups whose oldest step was served by a policy
    more than ``max_staleness`` versions behind the current one. A group the trajectory
    plane published ``partial`` (its timeout passed without every member) is dropped the
    same way (``stats.dropped_partial``) unless ``partial_groups="yield"``. ``ack_wait`` is how long
    an unacknowledged group waits after a crash before it is delivered again (heartbeats
    keep it from expiring while the trainer holds it; a clean ``close()`` hands back
    uncommitted groups at once). ``commit()`` rides out a NATS server restart: acks the
    server surely did not receive are retried for up to ``commit_timeout`` seconds.

    ``project`` hands out that project's groups only (others are acked unseen for this
    consumer and counted in ``stats.other_project``); ``None``: every project's. It is a filter
    of what the trainer reads, not a wall: a trainer's NATS credentials still reach the whole
    stream (per-project NATS accounts are not built; docs/projects.md).
    """

    def __init__(
        self,
        nats_url: str,
        *,
        name: str,
        max_staleness: int | None = None,
        current_policy_version: Callable[[], int | str | None] | None = None,
        ack_wait: float = 60.0,
        max_ack_pending: int = 1024,
        partial_groups: Literal["drop", "yield"] = "drop",
        commit_timeout: float = 30.0,
        project: str | None = None,
    ):
        if not name or any(c in name for c in ".*> \t\r\n"):
            raise ValueError(f"invalid trainer name {name!r}: no dots, wildcards or whitespace")
        if max_staleness is not None and current_policy_version is None:
            raise ValueError("max_staleness needs current_policy_version")
        if partial_groups not in ("drop", "yield"):
            raise ValueError(f"partial_groups must be 'drop' or 'yield', not {partial_groups!r}")
        if project is not None and (not project or any(c in project for c in "/.*> \t\r\n")):
            raise ValueError(f"invalid project {project!r}")
        self.project = project
        self.partial_groups = partial_groups
        self.commit_timeout = commit_timeout
        self.nats_url = nats_url
        self.name = name
        self.durable = f"trainer-{name}"
        self.max_staleness = max_staleness
        self.current_policy_version = current_policy_version
        self.ack_wait = ack_wait
        self.max_ack_pending = max_ack_pending
        self.stats = StreamStats()
        self._bus: Bus | None = None
        self._sub = None
        self._pending: dict[int, Msg] = {}  # stream sequence -> latest delivery, until committed
        self._yielded: set[str] = set()  # group ids handed out in this session
        self._heartbeat: asyncio.Task | None = None
        self._closed = False
        self._direct = True  # members read with direct gets (any replica) while the stream takes them

    # ----------------------------------------------------------------- lifecycle

    async def open(self) -> TrajectoryStream:
        self._bus = await Bus.connect(self.nats_url, self.durable)
        try:
            await self._bus.js.stream_info(STREAM)
        except NotFoundError:
            await self._bus.close()
            raise Unavailable(f"stream {STREAM} does not exist on {redact(self.nats_url)}: is Arena running? (the "
                              "topology step creates it: `arena up` does)") from None
        self._sub = await self._subscribe()
        self._heartbeat = asyncio.create_task(self._beat())
        return self

    async def close(self) -> None:
        """Hand uncommitted groups back for immediate redelivery and disconnect."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        pending, self._pending = list(self._pending.values()), {}
        for msg in pending:
            try:
                await msg.nak()
            except Exception:  # noqa: BLE001 - redelivered after ack_wait anyway
                pass
        if self._bus is not None:
            await self._bus.close()

    async def __aenter__(self) -> TrajectoryStream:
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _subscribe(self):
        config = jsapi.ConsumerConfig(
            durable_name=self.durable,
            filter_subject=GROUP_SUBJECTS,
            ack_policy=jsapi.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_deliver=-1,  # training data is never given up on
            max_ack_pending=self.max_ack_pending,
            deliver_policy=jsapi.DeliverPolicy.ALL,
        )
        await self._bus.js.add_consumer(STREAM, config)
        return await self._bus.js.pull_subscribe_bind(self.durable, STREAM)

    # ----------------------------------------------------------------- reading

    async def groups(self, batch_size: int = 1, *, max_wait: float | None = None) -> AsyncIterator[GroupBatch]:
        """Yield batches of ``batch_size`` groups, waiting for a full batch; with
        ``max_wait`` (seconds), a partial batch is yielded once its first group has
        waited that long. Runs until the stream is closed."""
        if self._sub is None:
            raise RuntimeError("the stream is not open: use `async with TrajectoryStream(...)`")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        while not self._closed:
            groups: list[GroupCompleted] = []
            seqs: list[int] = []
            deadline: float | None = None
            while len(groups) < batch_size and not self._closed:
                timeout = 1.0 if deadline is None else max(0.05, min(1.0, deadline - time.monotonic()))
                try:
                    msgs = await self._sub.fetch(batch=batch_size - len(groups), timeout=timeout)
                except (NatsTimeout, asyncio.TimeoutError):
                    msgs = []
                except Exception as exc:  # noqa: BLE001 - after a server restart: subscribe again
                    if self._closed:
                        break
                    log.warning("fetch on %s failed, resubscribing: %s", self.durable, exc)
                    await asyncio.sleep(0.5)
                    try:
                        self._sub = await self._subscribe()
                    except Exception as sub_exc:  # noqa: BLE001 - keep trying
                        log.warning("resubscribe failed: %s", sub_exc)
                    continue
                # concurrently: a group's members are read from the stream
                # (the cyclic GC paused meanwhile: its collections would scan every member as it is
                # decoded, and again as the group is; one collection afterwards scans them once)
                with _gc_paused():
                    accepted = await asyncio.gather(*(self._accept(msg) for msg in msgs))
                for msg, group in zip(msgs, accepted):
                    if group is not None:
                        groups.append(group)
                        seqs.append(msg.metadata.sequence.stream)
                        if deadline is None and max_wait is not None:
                            deadline = time.monotonic() + max_wait
                if deadline is not None and groups and time.monotonic() >= deadline:
                    break
            if not groups:
                continue
            self.stats.yielded += len(groups)
            yield GroupBatch(self, groups, seqs)

    async def _accept(self, msg: Msg) -> GroupCompleted | None:
        """The group to yield, or None when the message is settled here instead."""
        self.stats.received += 1
        seq = msg.metadata.sequence.stream
        if seq in self._pending:  # redelivered while we still hold it: keep the newest handle
            self._pending[seq] = msg
            return None
        try:
            group = _decode(await self._bus.body(msg))  # a group over max_payload is in the object store
        except (msgspec.DecodeError, BodyMissing) as exc:
            log.error("terminating undecodable message %d on %s: %s", seq, msg.subject, exc)
            self.stats.undecodable += 1
            await msg.term()
            return None
        except Unavailable as exc:  # its body cannot be read now: delivered again shortly
            log.warning("group %d on %s: %s", seq, msg.subject, exc)
            await msg.nak(delay=1.0)
            return None
        if self.project is not None and group.project != self.project:
            self.stats.other_project += 1
            await msg.ack()
            return None
        if group.members:  # the members by reference: read them
            group = await self._resolve(group, msg)
            if group is None:
                return None
        if group.group_id in self._yielded:
            self.stats.duplicates += 1
            await msg.ack()
            return None
        if group.partial and self.partial_groups == "drop":
            log.info("dropping partial group %s (missing members %s)", group.group_id, group.missing_indexes,
                     extra={"group_id": group.group_id})
            self.stats.dropped_partial += 1
            await msg.ack()
            return None
        if self.max_staleness is not None and is_stale(group, self.current_policy_version(), self.max_staleness):
            log.info("dropping stale group %s (policy %s)", group.group_id, group_policy_version(group),
                     extra={"group_id": group.group_id})
            self.stats.dropped_stale += 1
            await msg.ack()
            return None
        self._pending[seq] = msg
        self._yielded.add(group.group_id)
        return group

    async def _resolve(self, group: GroupCompleted, msg: Msg) -> GroupCompleted | None:
        """``group`` with its ``members`` read from the stream into ``trajectories``, or None
        when its message is settled here instead: again shortly (a member not there yet, or
        not readable now), or terminated (a member undecodable, or still missing after
        ``MEMBER_WAIT_DELIVERIES``)."""
        seq, delivered = msg.metadata.sequence.stream, msg.metadata.num_delivered
        try:
            members = await asyncio.gather(*(self._member(ref) for ref in group.members))
        except Unavailable as exc:
            log.warning("group %d on %s: %s", seq, msg.subject, exc)
            await msg.nak(delay=1.0)
            return None
        except (msgspec.DecodeError, BodyMissing) as exc:
            log.error("terminating group %d on %s: a member is undecodable: %s", seq, msg.subject, exc)
            self.stats.undecodable += 1
            await msg.term()
            return None
        except LookupError as exc:  # not on the stream (yet)
            if delivered < MEMBER_WAIT_DELIVERIES:
                await msg.nak(delay=1.0)
                return None
            log.error("terminating group %d on %s: %s after %d deliveries", seq, msg.subject, exc, delivered)
            self.stats.missing_members += 1
            await msg.term()
            return None
        return msgspec.structs.replace(group, trajectories=list(members), members=[])

    async def _member(self, ref: MemberRef) -> Trajectory:
        """The last message on ``ref.subject``: from any replica (a direct get), else, when
        that one has not got it (a follower behind) or the stream takes no direct gets,
        from the stream's leader."""
        js = self._bus.js
        raw = None
        if self._direct:
            try:
                raw = await js.get_msg(STREAM, subject=ref.subject, direct=True)
            except NotFoundError:
                pass
            except (NoRespondersError, NatsTimeout):  # no direct gets on this stream
                self._direct = False
        if raw is None:
            try:
                raw = await js.get_msg(STREAM, subject=ref.subject)
            except NotFoundError:
                raise LookupError(f"member {ref.group_index} ({ref.rollout_id}) is not on {ref.subject}") from None
            except (NoRespondersError, NatsTimeout, ConnectionClosedError) as exc:
                raise Unavailable(f"cannot read member {ref.rollout_id}: {exc}") from exc
        return _decode_trajectory(await self._bus.body(raw))

    async def _commit(self, seqs: list[int]) -> None:
        """Acknowledge ``seqs`` together (concurrently) and wait for the server's confirmations."""
        held = [(seq, self._pending[seq]) for seq in seqs if seq in self._pending]
        results = await asyncio.gather(*(self._ack(msg) for _, msg in held), return_exceptions=True)
        failed = None
        for (seq, _), result in zip(held, results):
            if isinstance(result, BaseException):
                failed = failed or result
                continue
            del self._pending[seq]
            self.stats.committed += 1
        if failed is not None:
            raise Unavailable(f"commit of {len(held)} groups on {self.durable} incomplete: {failed}") from failed

    async def _ack(self, msg: Msg) -> None:
        """``ack_sync``, retried while the server is away (a restart answers "no responders"
        or drops the connection: the ack surely did not land); a timeout is not retried (it
        may have landed). Gives up after ``commit_timeout`` seconds."""
        deadline = time.monotonic() + self.commit_timeout
        delay = 0.1
        while True:
            try:
                await msg.ack_sync(timeout=5.0)
                return
            except (NoRespondersError, ConnectionClosedError, StaleConnectionError):
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            for msg in list(self._pending.values()):
                try:
                    await msg.in_progress()
                except Exception:  # noqa: BLE001 - connection trouble; the next beat retries
                    pass
