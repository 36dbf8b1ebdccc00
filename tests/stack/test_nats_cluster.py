"""A NATS cluster of three nats-servers (``NatsCluster``, ``arena up --cluster 3``): it forms
one JetStream cluster, ``ensure_topology`` declares Arena's streams, KV buckets and object
store at 3 replicas (scaling ones that had 1), and what was acknowledged survives a node's
SIGKILL: it is read back from the others and the restarted node catches up."""

from __future__ import annotations

import asyncio
import time

import pytest

from arena_core import subjects
from arena_core.bus import Bus, TopologyError
from arena_stack.natsserver import NatsCluster, NatsServer

pytestmark = pytest.mark.timeout(120)

TOPOLOGY = ([s.name for s in subjects.STREAMS]
            + [f"KV_{b}" for b in (subjects.KV_ROLLOUTS, subjects.KV_BACKENDS, subjects.KV_VERIFIERS)]
            + [f"OBJ_{s}" for s in subjects.OBJECT_STORES])


@pytest.fixture
def cluster(tmp_path):
    c = NatsCluster(3, tmp_path / "cluster", sync="1s").start()
    try:
        yield c
    finally:
        c.stop()


async def wait_current(bus: Bus, stream: str, timeout: float = 20.0):
    """Until ``stream`` has a leader and all its replicas, each current (a scaled stream gets
    its new replicas a moment after the update); returns its info."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = await bus.js.stream_info(stream)
            peers = (info.cluster.replicas or []) if info.cluster else []
            if (info.cluster and info.cluster.leader and len(peers) == (info.config.num_replicas or 1) - 1
                    and all(r.current and not r.offline for r in peers)):
                return info
        except Exception:  # noqa: BLE001 - between leaders
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stream} not current after {timeout}s")
        await asyncio.sleep(0.1)


async def test_topology_at_three_replicas_and_a_publish_survives_a_node_sigkill(cluster):
    assert cluster.url.count("nats://") == 3 and cluster.meta_leader() in {n.server_name for n in cluster.nodes}
    bus = await Bus.connect(cluster.url, "test")  # the comma-separated list, as ARENA_NATS_URL
    try:
        await bus.ensure_topology(replicas=1)  # as a single server left it ...
        assert (await bus.js.stream_info("ARENA_STEPS")).config.num_replicas == 1
        await bus.ensure_topology(replicas=3)  # ... then scaled to the cluster, buckets too
        for name in TOPOLOGY:
            info = await wait_current(bus, name)
            assert info.config.num_replicas == 3, name
            assert len(info.cluster.replicas) == 2, name  # the leader and two followers
        await bus.ensure_topology(replicas=3)  # idempotent

        for i in range(20):
            await bus.publish("arena.step.r1", f"step {i}".encode(), msg_id=f"r1:{i}")
        kv = await bus.kv(subjects.KV_ROLLOUTS)
        await kv.put("r1", b"running")

        # SIGKILL the leader of the stream that was written to
        leader = (await bus.js.stream_info("ARENA_STEPS")).cluster.leader
        killed = cluster.index(leader)
        cluster.nodes[killed].stop(kill=True)
        t0 = time.monotonic()

        # read back, through a connection to the other two only
        others = ",".join(n.url for i, n in enumerate(cluster.nodes) if i != killed)
        other = await Bus.connect(others, "test-other")
        try:
            info = await wait_current_or_leader(other, "ARENA_STEPS")
            assert info.cluster.leader != leader and info.state.messages == 20
            recovered = time.monotonic() - t0
            await wait_current_or_leader(other, f"KV_{subjects.KV_ROLLOUTS}")  # its own election
            assert (await other.js.get_msg("ARENA_STEPS", 20)).data == b"step 19"
            assert (await (await other.kv(subjects.KV_ROLLOUTS)).get("r1")).value == b"running"
            # two of three is a quorum: writes go on, and the de-duplication window holds
            ack = await other.publish("arena.step.r1", b"step 20", msg_id="r1:20")
            assert ack.seq == 21
            assert (await other.publish("arena.step.r1", b"step 19", msg_id="r1:19")).duplicate
        finally:
            await other.close()

        # restart on the same ports and store: it rejoins and catches up
        cluster.start_node(killed)
        info = await wait_current(bus, "ARENA_STEPS")
        assert info.state.messages == 21 and len(info.cluster.replicas) == 2
        print(f"\nnew stream leader {recovered:.2f} s after SIGKILL of {leader}")
    finally:
        await bus.close()


async def wait_current_or_leader(bus: Bus, stream: str, timeout: float = 30.0):
    """Until ``stream`` has a (new) leader: the killed replica stays offline."""
    deadline = time.monotonic() + timeout
    js = bus.nc.jetstream(timeout=1)  # a JetStream API request gets no answer while there is no leader
    while True:
        try:
            info = await js.stream_info(stream)
            if info.cluster and info.cluster.leader:
                return info
        except Exception:  # noqa: BLE001 - no leader yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stream} has no leader after {timeout}s")
        await asyncio.sleep(0.1)


async def test_more_replicas_than_servers_is_a_clear_error(tmp_path):
    server = NatsServer(tmp_path / "nats", sync="1s").start()
    try:
        bus = await Bus.connect(server.url, "test")
        try:
            with pytest.raises(TopologyError, match=r"ARENA_ROLLOUTS with 3 replica\(s\)"):
                await bus.ensure_topology(replicas=3)
            await bus.ensure_topology()  # the default: 1, as before
            assert (await bus.js.stream_info("ARENA_ROLLOUTS")).config.num_replicas == 1
        finally:
            await bus.close()
    finally:
        server.stop()
