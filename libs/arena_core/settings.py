"""Settings: one explicit object, read from ``ARENA_*`` environment variables, passed down.

Bad values fail fast at start-up with a message naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlparse

import msgspec

from arena_core import capacity
from arena_core.capacity import Capacity


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the variable."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    #: JetStream replicas of Arena's streams, KV buckets and object store: 1 on one
    #: nats-server, 3 on a cluster of three (``arena up --cluster 3``); an existing one with
    #: another count is scaled to it at start-up (docs/deploy.md).
    nats_replicas: int = 1
    data_dir: str = ".arena"
    host: str = "127.0.0.1"
    #: API keys on the rollout and trajectory APIs (``arena keys create``; docs/deploy.md,
    #: "Authentication"): on (``auto``, the default, or ``keys``) on every host, loopback
    #: included, unless ``off`` (which every service start warns about).
    auth: str = "auto"
    rollout_port: int = 9090
    dashboard_port: int = 9091
    trajectory_port: int = 9092
    #: Health ports (``/healthz``, ``/readyz``) of the services with no API of their own;
    #: 0 = none. ``arena up`` picks free ones (docs/reliability.md).
    sandbox_health_port: int = 0
    verification_health_port: int = 0
    #: Base URL of the rollout service as sandboxes on this host reach it (the proxy), and
    #: as the verification service reaches its judge route. Unset ("", the default): derived
    #: at construction from ``host`` and ``rollout_port`` (:meth:`derived_public_url`), so moving
    #: ``ARENA_ROLLOUT_PORT`` moves it too; an explicit value is kept as given.
    public_url: str = ""
    #: A second port of the rollout service serving only the agents' proxy routes
    #: (``/proxy/{rollout_id}/...``, :mod:`arena_core.proxy_routes`), every other path a 404
    #: that never reaches the API; 0 = none. When set, agents are given ``public_url`` with
    #: this port (:attr:`agent_url`): what Kubernetes sandbox pods may reach (docs/kubernetes.md).
    proxy_port: int = 0
    #: OpenAI-compatible LLM backend the proxy forwards to (ends in ``/v1``).
    backend_url: str = "http://127.0.0.1:9093/v1"
    #: Policy version the backend serves, recorded on every step; "" if unknown.
    backend_policy_version: str = ""
    #: In-flight calls the proxy sends to that backend at once; more wait in a queue.
    backend_max_inflight: int = 64
    #: "" selects embedded chDB under ``data_dir``; else a ClickHouse server URL.
    clickhouse_url: str = ""
    #: Seconds after its first member is stored that an incomplete rollout group is
    #: published as a ``partial`` GroupCompleted; 0 never does (docs/trajectory.md).
    trajectory_group_timeout_s: int = 1800
    #: Providers this sandbox service runs, comma-separated: local, docker, mock.
    sandbox_provider: str = "local"
    #: Sandboxes a worker runs at once; 0 (the default) sizes it from memory (an agent mostly
    #: waits on its LLM, costing memory, not CPU): the memory free less ``sandbox_memory_reserve_mb``,
    #: over ``sandbox_memory_mb`` per sandbox, bounded by file descriptors (:mod:`arena_core.capacity`).
    sandbox_concurrency: int = 0
    #: The memory budget of one waiting sandbox, MiB, for sizing ``sandbox_concurrency`` (a trivial
    #: agent waiting on its LLM takes about that; docs/performance.md). Not a limit on a sandbox:
    #: heavier agents are held back at run time by ``sandbox_memory_reserve_mb``.
    sandbox_memory_mb: int = 20
    #: Memory kept free on a sandbox host, MiB: no sandbox starts while less is available.
    sandbox_memory_reserve_mb: int = 1024
    #: The nice level sandboxes run at (0-19), and the matching lower CPU weight of their cgroup
    #: (local) or container (docker): Arena's own services keep the CPU when agents saturate it.
    #: 0 = the same priority as the services.
    sandbox_nice: int = 10
    #: Owner label of this worker's sandboxes ("" = the host name): reaped at start-up.
    sandbox_owner: str = ""
    #: Warm sandboxes kept ready per image (0 = none).
    sandbox_pool_size: int = 0
    #: Default image of the docker provider (a task's ``image`` overrides it).
    sandbox_image: str = "arena/agent-base:latest"
    #: Docker-API engine URL ("" = the docker SDK's environment, DOCKER_HOST).
    docker_url: str = ""
    verify_concurrency: int = 2
    #: Seconds a rollout may stay in ``verifying`` (no verification result: the verify job
    #: never picked up, every verification worker down) before the rollout service's reaper
    #: fails it; a task whose verifier's own timeouts (plus set-up) are longer gets those.
    #: 0 never fails it (docs/rollout.md).
    verify_deadline_s: int = 1800
    #: Ended rollouts the rollout service's record cache remembers (to ignore stale
    #: revisions of them arriving late through its KV watch); the oldest are forgotten first.
    rollout_cache_ended: int = 100_000
    #: Shared secret of the verification service on the rollout service's judge route
    #: (``/judge/{rollout_id}/v1``); "" disables the route. ``arena up`` makes one per run.
    judge_key: str = ""
    #: Largest request body the proxy and API accept, bytes.
    max_body_bytes: int = 8 * 1024 * 1024
    #: Largest task bundle ``POST /v1/bundles`` accepts, bytes.
    max_bundle_bytes: int = 256 * 1024 * 1024
    #: What one task source (a bundle, a git commit's tree, an image's directory) may unpack to:
    #: bytes and files. ``POST /v1/bundles`` answers 413 past either; a worker never unpacks past
    #: them (docs/tasks.md, "Bounds").
    max_bundle_unpacked_bytes: int = 512 * 1024 * 1024
    max_bundle_files: int = 50_000
    #: Disk each worker's source cache (the sandbox service's, the verification service's) may
    #: take, bytes: past it the sources used least recently, and in use by no job, are evicted.
    #: 0 = unbounded.
    source_cache_bytes: int = 4 * 1024**3
    #: The largest agent diff kept, bytes: an agent whose diff is larger ends ``failed``, its
    #: diff's first ``max_diff_bytes`` kept as the artifact ``diff.truncated`` (docs/sandbox.md).
    max_diff_bytes: int = 10 * 1024 * 1024
    #: Git sources (docs/tasks.md): the schemes allowed (comma-separated among https, http, ssh,
    #: git); the hosts ("" = any; else comma-separated names or ``*.suffix``); and whether a host
    #: may resolve to a loopback, link-local, private or reserved address (off: every address
    #: the host resolves to must be public).
    git_allowed_schemes: str = "https"
    git_allowed_hosts: str = ""
    git_allow_private_hosts: bool = False
    #: Accept host paths as task sources (``repo``, ``source.path``, ``agent.path``,
    #: ``file://`` git URLs): embedded demos on one machine only. Off: tasks travel as
    #: bundles, git URLs or images (docs/tasks.md).
    allow_host_paths: bool = False
    #: The longest wall-clock budget a submitted task may ask for, seconds.
    max_wall_clock_s: int = 86400
    #: Seconds a rollout may wait for its sandbox to start its agent; past it the rollout ends
    #: as an infrastructure outcome with no reward (its wall clock starts with its agent).
    queue_timeout_s: int = 900
    #: A rollout's hard lifetime from submission (queue + run + verify), seconds, unless its task's
    #: ``budget.max_lifetime_s`` says otherwise: past it the reaper ends it and all it holds is
    #: reclaimed. 0 = no default lifetime (docs/rollout.md, Hard lifetime).
    rollout_max_lifetime_s: int = 21600
    #: Rollouts that may wait at once; submissions beyond it, or beyond what the queue drains
    #: within ``queue_timeout_s``, get 429 with Retry-After (docs/reliability.md).
    max_queued: int = 10_000
    #: OpenEnv episodes (docs/openenv.md): seconds a sandbox waits for its client's next action
    #: before it ends the episode (the client is gone); within the task's wall clock.
    openenv_idle_s: int = 900
    #: Seconds the environment endpoint waits for an episode's sandbox to come up on ``reset``
    #: (queueing, image start, the environment's own start) before it answers "still starting:
    #: reset again" (the next reset waits for the same episode); under OpenEnv's client timeout (60 s).
    openenv_start_timeout_s: int = 50
    #: Seconds ``submit`` waits for the verifier's reward before it answers ``done`` with
    #: ``reward: null`` (the reward then comes with ``state``); OpenEnv's client gives up after 60.
    openenv_submit_wait_s: int = 45
    log_level: str = "INFO"
    #: OTLP collector the services send their traces to ("" = no traces exported):
    #: ``http://host:4318`` over ``http/protobuf``, ``http://host:4317`` over ``grpc``
    #: (docs/observability.md).
    otlp_endpoint: str = ""
    #: ``http/protobuf`` or ``grpc``.
    otlp_protocol: str = "http/protobuf"

    def __post_init__(self) -> None:
        if not self.public_url:  # frozen: set once, here (``structs.replace`` keeps it as it is)
            msgspec.structs.force_setattr(self, "public_url", self.derived_public_url())

    def derived_public_url(self) -> str:
        """``http://{host}:{rollout_port}``: the rollout service on this host; a wildcard
        ``host`` (``0.0.0.0``, ``::``, "") is reached on the loopback address."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.rollout_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> Settings:
        env = os.environ if env is None else env
        values: dict = {}
        for field in msgspec.structs.fields(cls):
            var = "ARENA_" + field.name.upper()
            if var in env:
                raw = env[var]
                if field.type is bool:
                    if raw.strip().lower() not in {"1", "0", "true", "false", "yes", "no", "on", "off", ""}:
                        raise SettingsError(f"{var}={raw!r} is not a boolean (1/0, true/false)")
                    values[field.name] = raw.strip().lower() in {"1", "true", "yes", "on"}
                elif field.type is int:
                    try:
                        values[field.name] = int(raw)
                    except ValueError:
                        raise SettingsError(f"{var}={raw!r} is not an integer") from None
                else:
                    values[field.name] = raw
        values.update(overrides)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        for name in ("rollout_port", "dashboard_port", "trajectory_port", "sandbox_health_port",
                     "verification_health_port", "proxy_port"):
            port = getattr(self, name)
            if not (0 < port < 65536 or (port == 0 and name.endswith(("_health_port", "proxy_port")))):
                raise SettingsError(f"ARENA_{name.upper()}={port} is not a TCP port")
        if self.proxy_port and self.proxy_port == self.rollout_port:
            raise SettingsError(f"ARENA_PROXY_PORT={self.proxy_port} must differ from ARENA_ROLLOUT_PORT "
                                "(it serves only the proxy routes)")
        for name, schemes in (
            ("nats_url", {"nats", "tls"}),
            ("public_url", {"http", "https"}),
            ("backend_url", {"http", "https"}),
        ):
            url = urlparse(getattr(self, name))
            if url.scheme not in schemes or not url.netloc:
                raise SettingsError(
                    f"ARENA_{name.upper()}={getattr(self, name)!r} must be a {'/'.join(sorted(schemes))} URL"
                )
        if self.clickhouse_url and urlparse(self.clickhouse_url).scheme not in {"http", "https", "clickhouse"}:
            raise SettingsError(f"ARENA_CLICKHOUSE_URL={self.clickhouse_url!r} must be an http(s) URL")
        if self.trajectory_group_timeout_s < 0:
            raise SettingsError("ARENA_TRAJECTORY_GROUP_TIMEOUT_S must be >= 0")
        if self.backend_max_inflight < 1:
            raise SettingsError("ARENA_BACKEND_MAX_INFLIGHT must be >= 1")
        if self.sandbox_pool_size < 0:
            raise SettingsError("ARENA_SANDBOX_POOL_SIZE must be >= 0")
        if self.sandbox_memory_mb < 1 or self.sandbox_memory_reserve_mb < 0:
            raise SettingsError("ARENA_SANDBOX_MEMORY_MB must be >= 1 and ARENA_SANDBOX_MEMORY_RESERVE_MB >= 0")
        if not 0 <= self.sandbox_nice <= 19:
            raise SettingsError("ARENA_SANDBOX_NICE must be between 0 and 19")
        if self.sandbox_concurrency < 0 or self.verify_concurrency < 1:
            raise SettingsError("ARENA_SANDBOX_CONCURRENCY must be >= 0 (0: sized from the machine) and "
                                "ARENA_VERIFY_CONCURRENCY >= 1")
        if self.verify_deadline_s < 0:
            raise SettingsError("ARENA_VERIFY_DEADLINE_S must be >= 0 (0 = no deadline)")
        if not 1 <= self.max_wall_clock_s <= 7 * 86400:
            raise SettingsError("ARENA_MAX_WALL_CLOCK_S must be between 1 and 604800")
        if not 1 <= self.queue_timeout_s <= 7 * 86400:
            raise SettingsError("ARENA_QUEUE_TIMEOUT_S must be between 1 and 604800")
        if not 0 <= self.rollout_max_lifetime_s <= 8 * 86400:
            raise SettingsError("ARENA_ROLLOUT_MAX_LIFETIME_S must be between 0 (none) and 691200")
        if self.openenv_idle_s < 1 or self.openenv_start_timeout_s < 1 or self.openenv_submit_wait_s < 0:
            raise SettingsError("ARENA_OPENENV_IDLE_S and ARENA_OPENENV_START_TIMEOUT_S must be >= 1, "
                                "ARENA_OPENENV_SUBMIT_WAIT_S >= 0")
        if self.max_queued < 1:
            raise SettingsError("ARENA_MAX_QUEUED must be >= 1")
        if self.nats_replicas < 1:
            raise SettingsError("ARENA_NATS_REPLICAS must be >= 1")
        if self.rollout_cache_ended < 1:
            raise SettingsError("ARENA_ROLLOUT_CACHE_ENDED must be >= 1")
        if self.auth not in ("auto", "keys", "off"):
            raise SettingsError(f"ARENA_AUTH must be auto, keys or off, got {self.auth!r}")
        if self.otlp_endpoint and (urlparse(self.otlp_endpoint).scheme not in {"http", "https"}
                                   or not urlparse(self.otlp_endpoint).netloc):
            raise SettingsError(f"ARENA_OTLP_ENDPOINT={self.otlp_endpoint!r} must be an http(s) URL")
        if self.max_bundle_unpacked_bytes < 1 or self.max_bundle_files < 1:
            raise SettingsError("ARENA_MAX_BUNDLE_UNPACKED_BYTES and ARENA_MAX_BUNDLE_FILES must be >= 1")
        if self.source_cache_bytes < 0:
            raise SettingsError("ARENA_SOURCE_CACHE_BYTES must be >= 0 (0 = unbounded)")
        if self.max_diff_bytes < 1:
            raise SettingsError("ARENA_MAX_DIFF_BYTES must be >= 1")
        schemes = [s.strip().lower() for s in self.git_allowed_schemes.split(",") if s.strip()]
        if not schemes or not set(schemes) <= {"https", "http", "ssh", "git"}:
            raise SettingsError(f"ARENA_GIT_ALLOWED_SCHEMES={self.git_allowed_schemes!r} must list some of "
                                "https, http, ssh, git")
        if self.otlp_protocol not in ("http/protobuf", "grpc"):
            raise SettingsError(f"ARENA_OTLP_PROTOCOL must be http/protobuf or grpc, got {self.otlp_protocol!r}")

    def to_env(self) -> dict[str, str]:
        """The ``ARENA_*`` variables that reproduce these settings in a child process."""
        return {
            "ARENA_" + f.name.upper(): str(getattr(self, f.name)) for f in msgspec.structs.fields(self)
        }

    @property
    def agent_url(self) -> str:
        """The rollout service as agents reach it (their proxy base URLs start with it):
        ``public_url``, on ``proxy_port`` when there is one (the proxy-only listener)."""
        if not self.proxy_port:
            return self.public_url.rstrip("/")
        url = urlparse(self.public_url)
        host = url.hostname or ""
        host = f"[{host}]" if ":" in host else host
        return url._replace(netloc=f"{host}:{self.proxy_port}").geturl().rstrip("/")

    @property
    def sandbox_slots(self) -> int:
        """``sandbox_concurrency``, or (0) what this host's memory holds (:meth:`sandbox_capacity`)."""
        return self.sandbox_capacity().slots

    def sandbox_capacity(self) -> Capacity:
        """The sandboxes a worker runs at once and why: ``sandbox_concurrency`` if set, else sized
        from memory and file descriptors (:func:`arena_core.capacity.size`)."""
        if self.sandbox_concurrency:
            return Capacity(slots=self.sandbox_concurrency, reason="ARENA_SANDBOX_CONCURRENCY")
        return capacity.size(budget_mb=self.sandbox_memory_mb, reserve_mb=self.sandbox_memory_reserve_mb)

    @property
    def trajectory_url(self) -> str:
        return f"http://{self.host}:{self.trajectory_port}"

    @property
    def rollout_url(self) -> str:
        return f"http://{self.host}:{self.rollout_port}"
