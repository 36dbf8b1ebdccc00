"""OpenEnv episodes in real bubblewrap sandboxes, without a bus: ``run_job`` for an
``external`` agent serves exchanges from an in-memory source (Arena's tools on the
quickstart task; the ``openenv init`` echo environment hosted under bubblewrap)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import msgspec
import pytest

from arena.tasks import load_task
from arena_core.schemas import AgentSpec, Budget, EnvReply, EnvRequest, OpenEnvServer, SandboxJob, SandboxOutcome, Task
from arena_sandbox import runner
from arena_sandbox_providers.local_provider import LocalProvider

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
ECHO_ENV = ROOT / "examples" / "openenv-echo"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


class Script:
    """Exchanges from a list; each reply is kept beside its request."""

    def __init__(self, requests: list[EnvRequest], *, gap_s: float = 0.0):
        self.requests = list(requests)
        self.replies: list[EnvReply] = []
        self.gap_s = gap_s

    async def next(self, timeout_s: float):
        if not self.requests:
            await asyncio.sleep(timeout_s)
            return None
        if self.gap_s:
            await asyncio.sleep(self.gap_s)
        request = self.requests.pop(0)
        script = self

        class One:
            def __init__(self):
                self.request = request

            async def reply(self, answer: EnvReply) -> None:
                script.replies.append(answer)

        return One()


def call(seq: int, tool: str, **arguments) -> EnvRequest:
    return EnvRequest(rollout_id="r-ep", seq=seq, kind="step",
                      data={"type": "call_tool", "tool_name": tool, "arguments": arguments})


def job_of(task: Task) -> SandboxJob:
    return SandboxJob(rollout_id="r-ep", task=task, proxy_url="http://127.0.0.1:9/proxy/r-ep/v1", api_key="k")


@pytest.fixture
def provider(tmp_path):
    return LocalProvider(data_dir=tmp_path / "data", owner="episodes", use_cgroups=False)


def quickstart() -> Task:
    task = load_task(QUICKSTART)
    return msgspec.structs.replace(task, agent=AgentSpec(external=True), verifier=None)


async def test_tools_edit_the_workspace_and_submit_ends_the_episode_with_its_diff(tmp_path, provider):
    fixed = "    return (ordered[mid - 1] + ordered[mid]) / 2\n"
    script = Script([
        EnvRequest(rollout_id="r-ep", seq=0, kind="reset"),
        call(1, "shell", command="ls textstats && echo err >&2 && exit 3"),
        call(2, "read_file", path="textstats/core.py", offset=30, limit=3),
        call(3, "edit_file", path="textstats/core.py", old_str="    return (ordered[mid] + ordered[mid + 1]) / 2\n",
             new_str=fixed),
        call(3, "edit_file", path="textstats/core.py", old_str="never", new_str="twice"),  # a repeated seq: not run
        call(4, "write_file", path="notes/new.txt", content="hello\n"),
        call(5, "read_file", path="/etc/passwd"),
        call(6, "no_such_tool"),
        call(7, "shell", command=""),
        EnvRequest(rollout_id="r-ep", seq=8, kind="state"),
        EnvRequest(rollout_id="r-ep", seq=9, kind="step", data={"type": "call_tool", "bogus": 1}),
        call(10, "submit", answer="fixed"),
    ])
    run = await runner.run_job(job_of(quickstart()), data_dir=tmp_path / "work", provider=provider, exchanges=script)
    done = run.done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    assert done.reason == "the client submitted"
    replies = script.replies
    reset = replies[0].observation
    assert reset["prompt"].startswith("The `textstats` package") and reset["workdir"] == "/sandbox/workspace"
    assert [t["name"] for t in reset["tools"]] == ["shell", "read_file", "write_file", "edit_file", "submit"]
    shell = replies[1].observation["result"]
    assert shell["exit_code"] == 3 and "core.py" in shell["output"] and "err" in shell["output"]
    read = replies[2].observation["result"]
    assert read["content"].count("\n") == 3 and read["truncated"] is True
    assert replies[3].observation == {"tool_name": "edit_file", "result": {"replacements": 1}, "error": None}
    assert replies[4] == replies[3]  # the same seq answered again, not run twice
    assert replies[5].observation["result"] == {"bytes_written": 6}
    assert replies[6].observation["error"]["error_type"] == "invalid_args"  # outside the workspace
    assert replies[7].observation["error"]["error_type"] == "tool_not_found"
    assert replies[8].observation["error"]["error_type"] == "invalid_args"  # an empty command
    assert replies[9].state["step_count"] >= 7
    assert replies[10].error is not None and replies[10].error.code == "VALIDATION_ERROR"
    assert replies[11].done is True
    assert fixed.strip() in done.diff and "notes/new.txt" in done.diff
    assert done.result == {"answer": "fixed"}
    kinds = [(s.index, s.kind) for s in done.env_steps]
    assert kinds[0] == (0, "reset") and len(done.env_steps) == 10  # reset + 9 steps (state is not a step)
    assert done.env_steps[-1].done and done.env_steps[-1].action["tool_name"] == "submit"


async def test_a_write_through_a_link_the_agent_made_stays_inside_the_sandbox(tmp_path, provider):
    outside = tmp_path / "host-file.txt"
    outside.write_text("host\n")
    script = Script([
        EnvRequest(rollout_id="r-ep", seq=0, kind="reset"),
        call(1, "shell", command=f"ln -s {outside} link.txt && ln -s /etc linkdir"),
        call(2, "write_file", path="link.txt", content="pwned\n"),
        call(3, "read_file", path="linkdir/hostname"),
        call(4, "submit"),
    ])
    run = await runner.run_job(job_of(quickstart()), data_dir=tmp_path / "work", provider=provider, exchanges=script)
    assert run.done.outcome is SandboxOutcome.COMPLETED
    assert outside.read_text() == "host\n"  # the host's file is not the sandbox's
    assert script.replies[2].observation["error"]["error_type"] == "execution_error"


async def test_an_episode_with_no_client_ends_after_the_idle_time(tmp_path, provider):
    script = Script([EnvRequest(rollout_id="r-ep", seq=0, kind="reset")])
    run = await runner.run_job(job_of(quickstart()), data_dir=tmp_path / "work", provider=provider, exchanges=script,
                               idle_s=1.0)
    assert run.done.outcome is SandboxOutcome.TIMED_OUT
    assert "no action for 1s" in run.done.reason


async def test_a_cancelled_episode_ends_cancelled(tmp_path, provider):
    cancel = asyncio.Event()
    script = Script([EnvRequest(rollout_id="r-ep", seq=0, kind="reset")])
    asyncio.get_running_loop().call_later(1.0, cancel.set)
    run = await runner.run_job(job_of(quickstart()), data_dir=tmp_path / "work", provider=provider, exchanges=script,
                               cancel=cancel)
    assert run.done.outcome is SandboxOutcome.CANCELLED


@pytest.mark.timeout(180)
async def test_the_echo_environment_runs_under_bubblewrap_and_its_frames_are_relayed(tmp_path, provider):
    task = Task(id="echo", instructions="Echo.", agent=AgentSpec(external=True),
                environment=OpenEnvServer(path=str(ECHO_ENV)))
    script = Script([
        EnvRequest(rollout_id="r-ep", seq=0, kind="reset"),
        EnvRequest(rollout_id="r-ep", seq=1, kind="step", data={"message": "hello"}),
        EnvRequest(rollout_id="r-ep", seq=2, kind="step", data={"not_a_field": 1}),
        EnvRequest(rollout_id="r-ep", seq=3, kind="state"),
        EnvRequest(rollout_id="r-ep", seq=4, kind="step", data={"message": "hi"}),
        EnvRequest(rollout_id="r-ep", seq=5, kind="close"),
    ])
    run = await runner.run_job(job_of(task), data_dir=tmp_path / "work", provider=provider, exchanges=script)
    done = run.done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    replies = script.replies
    assert replies[0].observation == {"echoed_message": "Echo Env environment ready!", "message_length": 0}
    assert replies[1].observation == {"echoed_message": "hello", "message_length": 5}
    assert replies[1].reward == pytest.approx(0.5) and replies[1].done is False
    assert replies[2].error.code == "VALIDATION_ERROR" and replies[2].error.errors
    assert replies[3].state["step_count"] == 1
    assert done.result == {"env_rewards": [pytest.approx(0.5), pytest.approx(0.2)], "env_done": False}
    assert [s.kind for s in done.env_steps] == ["reset", "step", "step", "step"]
    assert done.env_steps[2].error.startswith("VALIDATION_ERROR")


async def test_an_environment_that_cannot_start_is_an_infrastructure_outcome(tmp_path, provider):
    broken = tmp_path / "broken-env"
    (broken / "server").mkdir(parents=True)
    (broken / "server" / "app.py").write_text("raise SystemExit('no such environment')\n")
    task = Task(id="broken", instructions="x", agent=AgentSpec(external=True),
                environment=OpenEnvServer(path=str(broken), ready_timeout_s=20))
    script = Script([EnvRequest(rollout_id="r-ep", seq=0, kind="reset")])
    run = await runner.run_job(job_of(task), data_dir=tmp_path / "work", provider=provider, exchanges=script)
    assert run.done.outcome is SandboxOutcome.ERROR
    assert "did not start" in run.done.reason and "no such environment" in run.done.reason


@pytest.mark.timeout(180)
async def test_a_started_server_serves_the_next_episode_of_its_environment(tmp_path, provider):
    from arena_sandbox.hosted import EnvServers

    servers = EnvServers(max_idle=2, idle_s=60)
    task = Task(id="echo", instructions="Echo.", agent=AgentSpec(external=True),
                environment=OpenEnvServer(path=str(ECHO_ENV)))
    durations, episode_ids = [], []
    try:
        for word in ("first", "second"):
            script = Script([
                EnvRequest(rollout_id="r-ep", seq=0, kind="reset"),
                EnvRequest(rollout_id="r-ep", seq=1, kind="step", data={"message": word}),
                EnvRequest(rollout_id="r-ep", seq=2, kind="state"),
                EnvRequest(rollout_id="r-ep", seq=3, kind="close"),
            ])
            run = await runner.run_job(job_of(task), data_dir=tmp_path / "work", provider=provider,
                                       exchanges=script, servers=servers)
            assert run.done.outcome is SandboxOutcome.COMPLETED, run.done.reason
            assert script.replies[1].observation["echoed_message"] == word
            assert script.replies[2].state["step_count"] == 1  # a fresh environment per episode
            episode_ids.append(script.replies[2].state["episode_id"])
            durations.append(run.done.finished_at - run.done.started_at)
        (waiting,) = servers.idle.values()
        assert len(waiting) == 1 and waiting[0].episodes == 2  # one server, two episodes
        assert episode_ids[0] != episode_ids[1]
    finally:
        await servers.close()
    assert not servers.idle
    assert not list((tmp_path / "data" / "sandboxes").glob("*/*/arena"))  # its sandbox destroyed


async def test_the_tools_run_in_a_docker_sandbox_too(tmp_path, docker_url):
    """The same episode on the docker provider (Podman here): the tools are commands in the container."""
    from arena_core.settings import Settings
    from arena_sandbox_providers.factory import build_provider

    settings = Settings(data_dir=str(tmp_path / "data"), docker_url=docker_url, sandbox_owner="episodes-docker")
    docker_provider = build_provider("docker", settings)
    task = msgspec.structs.replace(quickstart(), image="arena/quickstart:latest")
    script = Script([
        EnvRequest(rollout_id="r-ep", seq=0, kind="reset"),
        call(1, "shell", command="id -u && python3 -c 'print(6 * 7)'"),
        call(2, "write_file", path="notes/a.txt", content="docker\n"),
        call(3, "read_file", path="notes/a.txt"),
        call(4, "submit", answer="42"),
    ])
    try:
        run = await runner.run_job(job_of(task), data_dir=tmp_path / "work", provider=docker_provider,
                                   exchanges=script)
    finally:
        await docker_provider.close()
    assert run.done.outcome is SandboxOutcome.COMPLETED, run.done.reason
    assert run.done.provider == "docker"
    assert script.replies[1].observation["result"]["output"].split() == ["1000", "42"]
    assert script.replies[3].observation["result"]["content"] == "docker\n"
    assert "notes/a.txt" in run.done.diff and run.done.result == {"answer": "42"}


async def test_the_wall_clock_holds_during_a_step(tmp_path, provider):
    task = msgspec.structs.replace(quickstart(), budget=Budget(wall_clock_s=3))
    script = Script([EnvRequest(rollout_id="r-ep", seq=0, kind="reset"),
                     call(1, "shell", command="sleep 12; echo still-here", timeout_s=20)])
    run = await runner.run_job(job_of(task), data_dir=tmp_path / "work", provider=provider, exchanges=script)
    assert run.done.outcome is SandboxOutcome.TIMED_OUT, run.done.reason
    assert "during a step" in run.done.reason
    assert run.done.finished_at - run.done.started_at < 10  # the command was killed, not waited for


async def test_a_tool_on_a_binary_file_is_a_failed_call_and_the_episode_goes_on(tmp_path, provider):
    script = Script([
        EnvRequest(rollout_id="r-ep", seq=0, kind="reset"),
        call(1, "shell", command="printf 'a\\377b' > bin.dat"),
        call(2, "edit_file", path="bin.dat", old_str="a", new_str="c"),
        call(3, "submit"),
    ])
    run = await runner.run_job(job_of(quickstart()), data_dir=tmp_path / "work", provider=provider, exchanges=script)
    assert run.done.outcome is SandboxOutcome.COMPLETED, run.done.reason
    assert script.replies[2].observation["error"]["error_type"] == "execution_error"
    assert "not UTF-8" in script.replies[2].observation["error"]["message"]


async def test_an_episode_taken_over_mid_way_ends_as_arenas_failure(tmp_path, provider):
    """A job run again (a worker stopped, a redelivery) in a fresh sandbox: the client's next
    step must not run on a pristine workspace as if nothing happened."""
    script = Script([call(5, "shell", command="echo one"), call(6, "shell", command="echo two")])
    run = await runner.run_job(job_of(quickstart()), data_dir=tmp_path / "work", provider=provider, exchanges=script)
    assert run.done.outcome is SandboxOutcome.ERROR and "restarted" in run.done.reason
    assert script.replies[0].error.code == "SESSION_ERROR" and len(script.replies) == 1


async def test_warm_servers_are_capped_in_all_the_longest_idle_retired_first():
    from arena_sandbox.hosted import EnvServers

    class Server:
        def __init__(self, name):
            self.name, self.closed, self.idle_since = name, False, 0.0

        def alive(self):
            return not self.closed

        async def close(self):
            self.closed = True

    servers = EnvServers(max_idle=2, max_total=3, idle_s=60)
    made = {name: Server(name) for name in ("a1", "a2", "a3", "b1", "b2")}
    for name in ("a1", "a2", "a3", "b1", "b2"):  # a3: over a's own cap; b2: over the cap in all
        await servers.give(name[0], made[name])
        await asyncio.sleep(0.01)
    assert made["a3"].closed and made["a1"].closed  # a's own cap, then the longest idle in all
    assert [s.name for s in servers.idle["a"]] == ["a2"] and [s.name for s in servers.idle["b"]] == ["b1", "b2"]
    assert servers.take("b") is made["b2"] and servers.take("a") is made["a2"] and servers.take("a") is None
    await servers.close()
