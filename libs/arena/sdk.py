"""The Python SDK: submit rollouts and groups, follow them, fetch their trajectories.

Server errors come back as the matching ``arena_core.errors`` class (``NotFound``,
``InvalidRequest``...), carrying the server's code and message. Example: README.md ("From Python").
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec

from arena import endpoints
from arena_core import sources
from arena_core.apikeys import auth_headers
from arena_core.errors import BY_CODE, ArenaError, InvalidRequest, NotFound, Overloaded, Unavailable
from arena_core.schemas import (
    AgentSpec,
    BundleSource,
    DuelSubmitted,
    EnvironmentRequest,
    EnvironmentView,
    PathSource,
    GroupCompletion,
    GroupSubmitted,
    RolloutStateChanged,
    RolloutView,
    SamplingParams,
    SubmitDuelRequest,
    SubmitGroupRequest,
    SubmitRolloutRequest,
    Task,
    Trajectory,
    encode,
)

T = TypeVar("T")


class ArenaClient:
    def __init__(self, url: str | None = None, trajectory_url: str | None = None, *,
                 timeout: float = 30.0, transport: httpx.BaseTransport | None = None, overload_wait: float = 600.0,
                 api_key: str | None = None):
        """``url``, ``trajectory_url``, ``api_key``: the rollout API, the trajectory API and the key
        sent as ``Authorization: Bearer``; each unset one as ``arena.endpoints.resolve`` finds it
        (``ARENA_URL``, ``ARENA_TRAJECTORY_URL``, ``ARENA_API_KEY``, else the local stack and the key
        ``arena up`` left in ``$ARENA_DATA_DIR/api-key``); ``api_key=""`` sends none.
        ``overload_wait``: seconds a submission keeps retrying while the server answers 429
        ``overloaded`` (after each ``Retry-After``) before raising ``Overloaded``; 0 raises at once."""
        self.overload_wait = overload_wait
        self.endpoints = endpoints.resolve(url, trajectory_url, api_key)
        headers = auth_headers(self.endpoints.api_key or "")
        self._http = httpx.Client(base_url=self.endpoints.url, timeout=timeout, transport=transport, headers=headers)
        self._traj = httpx.Client(base_url=self.endpoints.trajectory_url, timeout=timeout, transport=transport,
                                  headers=headers)

    def close(self) -> None:
        self._http.close()
        self._traj.close()

    def __enter__(self) -> ArenaClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    @staticmethod
    def _check(resp: httpx.Response) -> bytes:
        if resp.status_code < 400:
            return resp.content
        try:
            err = msgspec.json.decode(resp.content)["error"]
            cls = BY_CODE.get(err["code"], ArenaError)
            exc = cls(err["message"])
            exc.status = resp.status_code
            if isinstance(exc, Overloaded):
                exc.retry_after = float(resp.headers.get("retry-after", "1") or 1)
        except Exception:  # noqa: BLE001 - not one of our error bodies
            exc = ArenaError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            exc.status = resp.status_code
        raise exc

    def _call(self, client: httpx.Client, method: str, path: str, type_: type[T] | None = None, **kw) -> Any:
        try:
            resp = client.request(method, path, **kw)
        except httpx.InvalidURL as exc:  # an id that cannot be in a URL (a newline pasted in, say)
            raise InvalidRequest(f"{path!r} cannot be asked for: {exc}") from None
        except httpx.ConnectError as exc:
            raise Unavailable(endpoints.not_running(str(client.base_url), exc)) from exc
        except httpx.HTTPError as exc:
            raise Unavailable(f"cannot reach {client.base_url}: {exc}") from exc
        data = self._check(resp)
        return msgspec.json.decode(data, type=type_) if type_ is not None else msgspec.json.decode(data)

    def _submit_call(self, path: str, type_: type[T], body: bytes) -> T:
        """POST a submission, waiting out 429 ``overloaded`` answers for up to ``overload_wait``."""
        deadline = time.monotonic() + self.overload_wait
        while True:
            try:
                return self._call(self._http, "POST", path, type_, content=body,
                                  headers={"content-type": "application/json"})
            except Overloaded as exc:
                left = deadline - time.monotonic()
                if exc.retry_after <= 0 or left <= 0:
                    raise
                time.sleep(min(max(exc.retry_after, 0.1), left))

    # ------------------------------------------------------------------ bundles

    def push_bundle(self, path: str | Path) -> str:
        """Upload the directory ``path`` as a content-addressed bundle (once); its digest."""
        data = sources.pack_dir(Path(path))
        digest = sources.digest_of(data)
        try:
            self._call(self._http, "GET", f"/v1/bundles/{digest}")
            return digest
        except NotFound:
            pass
        answer = self._call(self._http, "POST", "/v1/bundles", content=data,
                            headers={"content-type": "application/gzip"}, timeout=max(self._http.timeout.read or 0, 600))
        return answer["digest"]

    def fetch_bundle(self, digest: str) -> bytes:
        """A stored bundle's bytes (``GET /v1/bundles/{digest}/archive``, the ``submit`` scope),
        checked against ``digest``."""
        try:
            resp = self._http.get(f"/v1/bundles/{digest}/archive", timeout=max(self._http.timeout.read or 0, 600))
        except httpx.ConnectError as exc:
            raise Unavailable(endpoints.not_running(str(self._http.base_url), exc)) from exc
        except httpx.HTTPError as exc:
            raise Unavailable(f"cannot reach {self._http.base_url}: {exc}") from exc
        data = self._check(resp)
        if sources.digest_of(data) != digest:
            raise sources.SourceError(f"bundle {digest}: the bytes received do not match their digest")
        return data

    def prepare(self, task: Task) -> Task:
        """``task`` with every local directory it names (``repo`` / a path source, the agent's
        ``path``) uploaded as a bundle, so it runs on any worker of any machine."""
        source = task.source_of()
        if isinstance(source, PathSource):
            task = msgspec.structs.replace(task, repo="", source=BundleSource(digest=self.push_bundle(source.path)))
        if task.agent.path is not None:
            agent = msgspec.structs.replace(task.agent, path=None, bundle=self.push_bundle(task.agent.path))
            task = msgspec.structs.replace(task, agent=agent)
        if task.environment is not None and task.environment.path is not None:
            env = msgspec.structs.replace(task.environment, path=None,
                                          bundle=self.push_bundle(task.environment.path))
            task = msgspec.structs.replace(task, environment=env)
        return task

    # ------------------------------------------------------------------ environments (OpenEnv)

    def put_environment(self, name: str, task: Task, *, max_concurrent: int = 64,
                        sampling: SamplingParams | None = None, model: str = "default",
                        metadata: dict[str, str] | None = None, provider: str = "local") -> EnvironmentView:
        """Serve ``task`` over OpenEnv's protocol at ``/openenv/{name}`` (docs/openenv.md); its
        agent is made ``external`` (an OpenEnv client plays it). The answer's ``url`` is what an
        OpenEnv client takes as ``base_url``."""
        if not task.agent.external:
            task = msgspec.structs.replace(task, agent=AgentSpec(external=True))
        req = EnvironmentRequest(task=self.prepare(task), max_concurrent=max_concurrent,
                                 sampling=sampling or SamplingParams(), model=model, metadata=metadata or {},
                                 provider=provider)
        return self._call(self._http, "PUT", f"/v1/environments/{name}", EnvironmentView, content=encode(req),
                          headers={"content-type": "application/json"})

    def openenv_url(self, name: str) -> str:
        """What an OpenEnv client takes as ``base_url`` to play environment ``name`` with this
        client's key: OpenEnv's clients send no headers, so the key goes in the path
        (``/openenv/k/{key}/{name}``; docs/openenv.md), or ``/openenv/{name}`` with no key."""
        base = self.endpoints.url.rstrip("/")
        key = self.endpoints.api_key
        return f"{base}/openenv/k/{key}/{name}" if key else f"{base}/openenv/{name}"

    def environments(self) -> list[EnvironmentView]:
        answer = self._call(self._http, "GET", "/v1/environments")
        return [msgspec.convert(e, EnvironmentView) for e in answer["environments"]]

    # ------------------------------------------------------------------ rollouts

    def submit(self, task: Task, *, sampling: SamplingParams | None = None, model: str = "default",
               metadata: dict[str, str] | None = None, provider: str = "local") -> RolloutView:
        """``provider``: ``local`` (bubblewrap), ``docker`` (the task's image) or ``mock``."""
        task = self.prepare(task)
        req = SubmitRolloutRequest(task=task, sampling=sampling or SamplingParams(), model=model,
                                   metadata=metadata or {}, provider=provider)
        return self._submit_call("/v1/rollouts", RolloutView, encode(req))

    def submit_group(self, task: Task, *, n: int, seed: int | None = None, sampling: SamplingParams | None = None,
                     model: str = "default", metadata: dict[str, str] | None = None,
                     provider: str = "local", first_k: int | None = None,
                     deadline_s: float | None = None) -> GroupSubmitted:
        """``n`` members of ``task``. ``first_k``: the group is done once ``first_k`` members ended
        with a reward (the rest cancelled); ``deadline_s``: the members not ended that long after
        submission are cancelled. Neither: every member (docs/rollout.md, Group completion)."""
        sampling = sampling or SamplingParams()
        if seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=seed)
        task = self.prepare(task)
        req = SubmitGroupRequest(task=task, n=n, sampling=sampling, model=model, metadata=metadata or {},
                                 provider=provider, completion=GroupCompletion(first_k=first_k, deadline_s=deadline_s))
        return self._submit_call("/v1/rollout-groups", GroupSubmitted, encode(req))

    def submit_duel(self, task: Task, *, policies: Sequence[str], n: int, seed: int | None = None,
                    sampling: SamplingParams | None = None, metadata: dict[str, str] | None = None,
                    provider: str = "local") -> DuelSubmitted:
        """The same task for two policies (model names) on seeds ``seed .. seed + n - 1``
        (``seed`` unset: ``sampling.seed``, else 0); each round is decided by the verifier."""
        sampling = sampling or SamplingParams()
        if seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=seed)
        task = self.prepare(task)
        req = SubmitDuelRequest(task=task, policies=list(policies), n=n, sampling=sampling,
                                metadata=metadata or {}, provider=provider)
        return self._submit_call("/v1/duels", DuelSubmitted, encode(req))

    def get(self, rollout_id: str) -> RolloutView:
        return self._call(self._http, "GET", f"/v1/rollouts/{rollout_id}", RolloutView)

    def list(self, *, state: str | None = None, group_id: str | None = None,
             limit: int | None = None) -> list[RolloutView]:
        """Rollouts, oldest first; ``limit``: the newest that many (the API's default 1000, at most
        100000), counted before ``group_id`` is applied (the API filters the group after its limit)."""
        params: dict[str, str | int] = {k: v for k, v in (("state", state), ("group_id", group_id)) if v is not None}
        if limit is not None:
            params["limit_"] = limit
        body = self._call(self._http, "GET", "/v1/rollouts", params=params)
        return msgspec.convert(body["rollouts"], list[RolloutView])

    def projects(self) -> dict:
        """Projects' quotas and priorities and what each holds now (``GET /v1/projects``): every
        project for an admin key, the key's own for a project's key. docs/projects.md."""
        return self._call(self._http, "GET", "/v1/projects")

    def set_project(self, project: str, *, max_sandboxes: int | None = None, max_queued: int | None = None,
                    priority: str | None = None, weight: float | None = None) -> dict:
        """Set a project's quotas and priority (an admin key); ``None`` keeps the stored value."""
        fields = {k: v for k, v in (("max_sandboxes", max_sandboxes), ("max_queued", max_queued),
                                    ("priority", priority), ("weight", weight)) if v is not None}
        return self._call(self._http, "PUT", f"/v1/projects/{project}", json=fields)

    def cancel(self, rollout_id: str) -> RolloutView:
        return self._call(self._http, "POST", f"/v1/rollouts/{rollout_id}/cancel", RolloutView)

    def wait(self, rollout_id: str, *, timeout: float = 600.0) -> RolloutView:
        """Long-poll until the rollout is final (or ``timeout`` passes; then it is returned as is)."""
        deadline = time.monotonic() + timeout
        while True:
            step = max(0.0, min(60.0, deadline - time.monotonic()))
            view = self._call(self._http, "GET", f"/v1/rollouts/{rollout_id}/wait", RolloutView,
                              params={"timeout": step}, timeout=step + 10)
            if view.state.is_final or time.monotonic() >= deadline:
                return view

    def events(self, rollout_id: str) -> Iterator[RolloutStateChanged]:
        """The rollout's state transitions (server-sent events), until a final one."""
        with self._http.stream("GET", f"/v1/rollouts/{rollout_id}/events", timeout=None) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    event = msgspec.json.decode(line[6:], type=RolloutStateChanged)
                    yield event
                    if event.to_state.is_final:
                        return

    # ------------------------------------------------------------------ trajectories

    def trajectory(self, rollout_id: str) -> Trajectory:
        return self._call(self._traj, "GET", f"/v1/trajectories/{rollout_id}", Trajectory)

    def wait_trajectory(self, rollout_id: str, *, timeout: float = 60.0) -> Trajectory:
        """The trajectory, waiting for the trajectory plane to assemble it."""
        from arena_core.errors import NotFound

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.trajectory(rollout_id)
            except NotFound:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def group(self, group_id: str) -> dict[str, Any]:
        return self._call(self._traj, "GET", f"/v1/groups/{group_id}")

    # ------------------------------------------------------------------ duels

    def duels(self, *, limit: int = 50) -> list[dict[str, Any]]:
        """The latest duels, newest first (``GET /v1/duels``)."""
        return self._call(self._traj, "GET", "/v1/duels", params={"limit": limit})["duels"]

    def duel(self, duel_id: str) -> dict[str, Any]:
        """One duel with its rounds as stored so far; ``NotFound`` until a side is stored."""
        return self._call(self._traj, "GET", f"/v1/duels/{duel_id}")

    def wait_duel(self, duel_id: str, *, timeout: float = 600.0, on_round=None, poll: float = 0.5) -> dict[str, Any]:
        """The duel once every round is decided (or as it is when ``timeout`` passes);
        ``on_round(round)`` is called once for each round as it is decided."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while True:
            try:
                duel = self.duel(duel_id)
            except NotFound:
                duel = None
            if duel is not None:
                for r in duel["rounds"]:
                    if r["winner"] != "pending" and r["seed"] not in seen:
                        seen.add(r["seed"])
                        if on_round is not None:
                            on_round(r)
                if duel["complete"]:
                    return duel
            if time.monotonic() >= deadline:
                if duel is None:
                    raise NotFound(f"duel {duel_id}: no trajectory stored after {timeout:g} s")
                return duel
            time.sleep(poll)

    def leaderboard(self) -> dict[str, Any]:
        """Bradley–Terry ratings of every policy over every decided duel round (``GET /v1/leaderboard``)."""
        return self._call(self._traj, "GET", "/v1/leaderboard")

    def store_eval_report(self, report_json: bytes) -> dict[str, Any]:
        """Keep an ``arena eval`` report (its ``report.json``) on the trajectory service, where the
        dashboard's Evaluations page reads it (``POST /v1/evals``)."""
        return self._call(self._traj, "POST", "/v1/evals", content=report_json,
                          headers={"content-type": "application/json"})
