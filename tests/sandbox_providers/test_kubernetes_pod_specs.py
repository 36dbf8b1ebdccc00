"""The ``kubernetes`` provider's specs: the sandbox Pod and the owner's NetworkPolicy.

**No cluster runs here**: these tests check the pure spec builders of
``arena_sandbox_providers.kubernetes_provider`` (limits, no service-account token, the
security context, ownership labels, egress only to the proxy), validate the specs against
the official Kubernetes JSON schema with ``kubernetes-validate`` when it is installed
(skipped otherwise), and run the in-pod helper's file operations (put, read, exists) as a
local subprocess. Creating pods, exec over the API, NetworkPolicy enforcement and reaping
against a real API server are not exercised (docs/kubernetes.md, "verified here / not run here").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arena_core.settings import Settings, SettingsError
from arena_sandbox_providers import factory
from arena_sandbox_providers.kubernetes_provider import (
    HELPER,
    INIT,
    KubernetesConfig,
    KubernetesProvider,
    dns_label,
    label_value,
    network_policy,
    owner_labels,
    pod_spec,
    sandbox_path,
    tar_of_dir,
    tar_of_files,
)
from arena_sandbox_providers.provider import CreateSpec, SandboxError, SandboxLimits, SandboxProvider

LIMITS = SandboxLimits(memory_bytes=3 * 1024**3, cpus=1.5, pids=256, open_files=1024, tmp_bytes=256 * 1024**2,
                       file_size_bytes=1024**3)


def make_pod(**kw):
    args = dict(name="arena-sbx-0123456789ab", namespace="arena-sandboxes", owner="arena-sandbox-0",
                sandbox_id="0123456789ab", image="arena/quickstart:latest", limits=LIMITS,
                workspace_bytes=5 * 1024**3, active_deadline_s=90000)
    args.update(kw)
    return pod_spec(**args)


def make_policy(**kw):
    args = dict(namespace="arena-sandboxes", owner="arena-sandbox-0", proxy_port=9090,
                proxy_labels={"app.kubernetes.io/name": "arena-rollout"}, proxy_namespace="arena")
    args.update(kw)
    return network_policy(**args)


def container(pod: dict) -> dict:
    (only,) = pod["spec"]["containers"]
    return only


# ---------------------------------------------------------------------------- the Pod

def test_limits_come_from_the_sandbox_limits_and_requests_equal_them():
    resources = container(make_pod())["resources"]
    assert resources["limits"] == {"cpu": "1500m", "memory": str(3 * 1024**3), "ephemeral-storage": str(6 * 1024**3)}
    assert resources["requests"] == resources["limits"]  # nice 0: Guaranteed QoS
    # ARENA_SANDBOX_NICE=10: the CPU request a tenth of the limit (a waiting agent reserves little
    # of a node, and weighs less than Arena's pods), memory and storage still reserved whole
    lowered = container(make_pod(nice=10))["resources"]
    assert lowered["limits"] == resources["limits"]
    assert lowered["requests"] == {**resources["limits"], "cpu": "161m"}
    volumes = {v["name"]: v["emptyDir"] for v in make_pod()["spec"]["volumes"]}
    assert volumes["tmp"] == {"medium": "Memory", "sizeLimit": str(256 * 1024**2)}
    assert volumes["sandbox"] == {"sizeLimit": str(5 * 1024**3)}
    assert all("hostPath" not in v for v in make_pod()["spec"]["volumes"])


def test_no_service_account_token_no_host_namespaces_no_restart():
    spec = make_pod()["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["hostNetwork"] is spec["hostPID"] is spec["hostIPC"] is spec["shareProcessNamespace"] is False
    assert spec["terminationGracePeriodSeconds"] == 0
    assert spec["activeDeadlineSeconds"] == 90000
    assert "serviceAccountName" not in spec


def test_non_root_no_privilege_escalation_no_capabilities():
    spec = make_pod()["spec"]
    assert spec["securityContext"] == {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True, "fsGroup": 1000,
                                       "seccompProfile": {"type": "RuntimeDefault"}}
    ctx = container(make_pod())["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["privileged"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 1000


def test_meets_pod_security_restricted():
    """The rules of the "restricted" Pod Security Standard that a Pod spec can break
    (the sandbox namespace enforces it)."""
    spec = make_pod()["spec"]
    for c in [*spec["containers"], *spec.get("initContainers", [])]:
        ctx = c["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
        assert not ctx.get("capabilities", {}).get("add")
        assert "ports" not in c or all("hostPort" not in p for p in c["ports"])
    assert spec["securityContext"]["seccompProfile"]["type"] in {"RuntimeDefault", "Localhost"}
    allowed_volumes = {"emptyDir", "configMap", "secret", "projected", "downwardAPI", "persistentVolumeClaim",
                       "ephemeral", "csi"}
    assert all(set(v) - {"name"} <= allowed_volumes for v in spec["volumes"])


def test_image_command_and_mounts():
    c = container(make_pod())
    assert c["image"] == "arena/quickstart:latest" and c["imagePullPolicy"] == "IfNotPresent"
    assert c["command"] == INIT and c["command"][:3] == ["python3", "-I", "-S"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert set(mounts) == {"/sandbox", "/run/arena", "/tmp"}
    with_mount = {m["mountPath"]: m for m in container(make_pod(workspace_mount="/testbed"))["volumeMounts"]}
    assert with_mount["/testbed"] == {"name": "sandbox", "mountPath": "/testbed", "subPath": "workspace"}
    for bad in ("/sandbox/x", "/etc", "relative", "/"):
        with pytest.raises(SandboxError):
            make_pod(workspace_mount=bad)


def test_owner_labels_let_a_restarted_worker_find_its_pods():
    meta = make_pod()["metadata"]
    assert meta["labels"] == {"arena.sandbox": "1", "arena.owner": "arena-sandbox-0", "arena.sandbox_id": "0123456789ab",
                              "app.kubernetes.io/managed-by": "arena-sandbox"}
    assert meta["annotations"] == {"arena.owner": "arena-sandbox-0"}
    assert owner_labels("arena-sandbox-0") == {"arena.sandbox": "1", "arena.owner": "arena-sandbox-0"}


def test_owners_that_are_not_label_values_become_distinct_valid_ones():
    import re

    valid = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
    long_a, long_b = "host-" + "a" * 80, "host-" + "a" * 79 + "b"
    for owner in ("ok-owner", "_lead.and.trail_", long_a, long_b, "weird owner/with:chars"):
        assert valid.match(label_value(owner)), owner
    assert label_value("ok-owner") == "ok-owner"
    assert label_value(long_a) != label_value(long_b)
    assert dns_label("Arena_Sandbox-HOST.1") != "Arena_Sandbox-HOST.1"
    assert re.match(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", dns_label("Arena_Sandbox-HOST.1" * 5))


def test_optional_scheduling_fields():
    spec = make_pod(runtime_class="gvisor", node_selector={"arena/sandbox": "true"},
                    image_pull_secrets=("regcred",))["spec"]
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["nodeSelector"] == {"arena/sandbox": "true"}
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    plain = make_pod(active_deadline_s=None)["spec"]
    assert not {"runtimeClassName", "nodeSelector", "imagePullSecrets", "activeDeadlineSeconds"} & set(plain)


# ---------------------------------------------------------------------------- the NetworkPolicy

def test_policy_selects_the_owners_sandboxes_denies_ingress_and_allows_only_the_proxy():
    policy = make_policy()
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == "arena-sandboxes"
    assert spec["podSelector"] == {"matchLabels": owner_labels("arena-sandbox-0")}
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    assert spec["ingress"] == []  # exec goes through the API server and the kubelet
    (rule,) = spec["egress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9090}]
    assert rule["to"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "arena-rollout"}},
                           "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "arena"}}}]
    # no DNS, no other port, no open peer
    assert all(p["port"] != 53 for r in spec["egress"] for p in r["ports"])
    assert all(r.get("to") for r in spec["egress"])


def test_policy_with_cidrs_and_errors():
    spec = make_policy(proxy_labels=None, proxy_cidrs=("10.0.0.5/32",), proxy_port=8443)["spec"]
    assert spec["egress"] == [{"to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}], "ports": [{"protocol": "TCP", "port": 8443}]}]
    with pytest.raises(ValueError):
        make_policy(proxy_labels=None)
    with pytest.raises(ValueError):
        make_policy(proxy_port=0)


def test_provider_policy_defaults_to_the_rollout_pods():
    provider = KubernetesProvider(owner="w-0", config=KubernetesConfig(proxy_port=9090))
    rule = provider.policy()["spec"]["egress"][0]
    assert rule["to"][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "arena-rollout"}}
    assert rule["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]


# ---------------------------------------------------------------------------- schema

kv = None
try:
    import kubernetes_validate as kv  # noqa: F811
except ImportError:  # pragma: no cover - the schema tests skip
    pass


@pytest.mark.skipif(kv is None, reason="kubernetes-validate is not installed: specs not checked against the schema")
@pytest.mark.parametrize("version", ["1.30.0", "latest"])
def test_specs_are_valid_against_the_kubernetes_schema(version):
    version = kv.latest_version() if version == "latest" else version
    for doc in (make_pod(), make_pod(workspace_mount="/testbed", runtime_class="gvisor", node_selector={"a": "b"},
                                     image_pull_secrets=("r",)),
                make_policy(), make_policy(proxy_cidrs=("192.168.0.0/16",))):
        kv.validate(doc, version, strict=True)


# ---------------------------------------------------------------------------- settings, factory

def test_config_from_env():
    config = KubernetesConfig.from_env({}, public_url="http://arena-rollout.arena.svc:9090")
    assert config.namespace == "arena-sandboxes" and config.proxy_port == 9090
    assert config.proxy_labels == {"app.kubernetes.io/name": "arena-rollout"}
    config = KubernetesConfig.from_env({
        "ARENA_K8S_NAMESPACE": "sbx", "ARENA_K8S_PROXY_SELECTOR": "app=proxy, tier=llm",
        "ARENA_K8S_PROXY_NAMESPACE": "llm", "ARENA_K8S_PROXY_CIDRS": "10.1.0.0/16, 10.2.0.1/32",
        "ARENA_K8S_NODE_SELECTOR": "pool=sandbox", "ARENA_K8S_RUNTIME_CLASS": "kata",
        "ARENA_K8S_IMAGE_PULL_SECRETS": "a,b", "ARENA_K8S_WORKSPACE_BYTES": "1000",
        "ARENA_K8S_START_TIMEOUT_S": "12.5", "ARENA_K8S_KUBECONFIG": "/k", "ARENA_K8S_CONTEXT": "c",
    }, public_url="https://proxy.example")
    assert config.proxy_port == 443 and config.namespace == "sbx"
    assert config.proxy_labels == {"app": "proxy", "tier": "llm"} and config.proxy_namespace == "llm"
    assert config.proxy_cidrs == ("10.1.0.0/16", "10.2.0.1/32") and config.node_selector == {"pool": "sandbox"}
    assert config.runtime_class == "kata" and config.image_pull_secrets == ("a", "b")
    assert config.workspace_bytes == 1000 and config.start_timeout_s == 12.5
    assert (config.kubeconfig, config.context) == ("/k", "c")
    for bad in ({"ARENA_K8S_PROXY_SELECTOR": "novalue"}, {"ARENA_K8S_WORKSPACE_BYTES": "x"},
                {"ARENA_K8S_PROXY_PORT": "70000"}, {"ARENA_K8S_START_TIMEOUT_S": "-1"}):
        with pytest.raises(SettingsError):
            KubernetesConfig.from_env(bad)


def test_factory_builds_it_without_touching_a_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("ARENA_K8S_NAMESPACE", "sbx")
    assert "kubernetes" in factory.PROVIDERS
    settings = Settings(data_dir=str(tmp_path), sandbox_owner="arena-sandbox-1", public_url="http://r.arena.svc:9090",
                        sandbox_image="arena/agent-base:1")
    provider = factory.build_provider("kubernetes", settings)
    assert isinstance(provider, KubernetesProvider) and isinstance(provider, SandboxProvider)
    assert provider.name == "kubernetes" and provider.owner == "arena-sandbox-1"
    assert provider.config.namespace == "sbx" and provider.config.proxy_port == 9090
    assert provider.active_deadline_s == settings.max_wall_clock_s + 3600
    assert provider.pool_key(CreateSpec()).image == "arena/agent-base:1"
    assert provider._core is None  # the client is made on first use


def test_with_a_proxy_only_port_the_pods_may_reach_only_it(tmp_path, monkeypatch):
    """ARENA_PROXY_PORT set: the sandbox pods' policy allows that port of the rollout pods (the
    rollout service's proxy-only listener), never the API's port of ARENA_PUBLIC_URL."""
    monkeypatch.delenv("ARENA_K8S_PROXY_PORT", raising=False)
    settings = Settings(data_dir=str(tmp_path), sandbox_owner="arena-sandbox-1", public_url="http://r.arena.svc:9090",
                        proxy_port=9096)
    assert settings.agent_url == "http://r.arena.svc:9096"
    provider = factory.build_provider("kubernetes", settings)
    assert provider.config.proxy_port == 9096
    (rule,) = provider.policy()["spec"]["egress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9096}]


# ---------------------------------------------------------------------------- files (tar over exec)

def test_sandbox_paths():
    assert sandbox_path("/sandbox/workspace/a/../b") == "/sandbox/workspace/b"
    for bad in ("/etc/passwd", "/sandbox", "/sandbox/other/x", "relative/x"):
        with pytest.raises(SandboxError):
            sandbox_path(bad)


def run_helper(head: dict, payload: bytes = b"") -> subprocess.CompletedProcess:
    """The in-pod helper, run here as a subprocess for the operations that touch only the
    paths they are given (never ``run``/``killall``, which signal every process of the uid)."""
    assert head["op"] in {"put", "read", "exists"}
    return subprocess.run([sys.executable, "-I", "-S", "-c", HELPER], input=json.dumps(head).encode() + b"\n" + payload,
                          capture_output=True, timeout=60)


def test_helper_puts_reads_and_checks_files(tmp_path):
    target = tmp_path / "sandbox"
    archive = tar_of_files({f"{target}/workspace/a.txt": b"hello", f"{target}/.arena/task.json": b"{}"},
                           dirs=(f"{target}/agent",))
    done = run_helper({"op": "put", "size": len(archive)}, archive)
    assert done.returncode == 0, done.stderr
    assert (target / "workspace" / "a.txt").read_bytes() == b"hello" and (target / "agent").is_dir()
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_bytes(b"x" * 10)
    os.symlink("sub/f", src / "link")
    archive = tar_of_dir(src, f"{target}/workspace/repo")
    assert run_helper({"op": "put", "size": len(archive)}, archive).returncode == 0
    assert (target / "workspace" / "repo" / "sub" / "f").read_bytes() == b"x" * 10
    assert os.readlink(target / "workspace" / "repo" / "link") == "sub/f"

    read = run_helper({"op": "read", "path": str(target / "workspace" / "a.txt"), "max": 3})
    assert read.returncode == 0 and read.stdout == b"hell"  # max_bytes + 1
    assert run_helper({"op": "read", "path": str(target / "workspace" / "repo" / "link"), "max": 99}).returncode == 3
    assert run_helper({"op": "read", "path": str(target / "workspace"), "max": 99}).returncode == 3
    assert run_helper({"op": "read", "path": str(target / "missing"), "max": 99}).returncode == 3
    assert run_helper({"op": "exists", "path": str(target / "workspace" / "repo" / "link")}).returncode == 0
    assert run_helper({"op": "exists", "path": str(target / "missing")}).returncode == 3


def test_helper_and_init_are_valid_python():
    compile(HELPER, "helper", "exec")
    compile(INIT[-1], "init", "exec")
    assert Path(sys.executable).exists()


# ---------------------------------------------------------------------------- exec protocol (fake stream)

class FakeStream:
    """Stands in for the client's WSClient: what the helper would answer, no pod behind it."""

    def __init__(self, cluster: FakeCluster):
        self.cluster, self.stdin, self.sent, self.open, self.code = cluster, b"", False, True, None
        self.channels: dict[int, bytes] = {}

    def write_stdin(self, data: bytes) -> None:
        self.stdin += data

    def head(self) -> dict | None:
        line, sep, _ = self.stdin.partition(b"\n")
        return json.loads(line) if sep else None

    def update(self, timeout: float = 0) -> None:
        import time

        time.sleep(min(timeout, 0.01))
        head = self.head()
        if head is None or not self.open:
            return
        if head not in self.cluster.heads:
            self.cluster.heads.append(head)
        if head["op"] == "killall":
            self.cluster.killed = True
            self.open, self.code = False, 0
        elif head["op"] == "run" and head["argv"] == ["hang"]:
            if self.cluster.killed:
                self.open, self.code = False, 137
        elif head["op"] == "run":
            self.channels = {1: b"out:" + " ".join(head["argv"]).encode(), 2: b"err"}
            self.open, self.code = False, int(head["env"].get("CODE", "0"))
        else:
            self.open, self.code = False, 0

    def is_open(self) -> bool:
        return self.open

    def read_channel(self, channel: int, timeout: float = 0) -> bytes:
        return self.channels.pop(channel, b"")

    @property
    def returncode(self):
        return self.code

    def close(self) -> None:
        self.open = False


class FakeCluster:
    def __init__(self):
        self.heads: list[dict] = []
        self.killed = False
        self.deleted: list[str] = []


def fake_sandbox(monkeypatch):
    from arena_sandbox_providers.kubernetes_provider import KubernetesSandbox

    cluster = FakeCluster()
    provider = KubernetesProvider(owner="w-0")
    monkeypatch.setattr(provider, "open_exec", lambda pod, command: FakeStream(cluster))

    async def delete_pod(name):
        cluster.deleted.append(name)

    async def resolve(host, port):
        return "10.0.0.7"

    monkeypatch.setattr(provider, "delete_pod", delete_pod)
    monkeypatch.setattr(provider, "resolve", resolve)
    return KubernetesSandbox("abc", "arena-sbx-abc", provider, LIMITS), cluster


async def test_exec_sends_the_command_streams_output_and_returns_the_code(monkeypatch):
    from arena_sandbox_providers.local import ProxyForward

    sandbox, cluster = fake_sandbox(monkeypatch)
    chunks: list[bytes] = []
    result = await sandbox.exec(["echo", "hi"], env={"CODE": "3", "OPENAI_API_KEY": "k"}, workdir="/sandbox/workspace",
                                proxy=ProxyForward(host="arena-rollout.arena.svc", port=80), on_output=chunks.append)
    assert result.exit_code == 3 and not result.killed and not result.oom_killed
    assert b"".join(chunks) in (b"out:echo hierr", b"errout:echo hi")
    (head,) = cluster.heads
    assert head["argv"] == ["echo", "hi"] and head["env"]["OPENAI_API_KEY"] == "k"
    assert head["relay"] == [10080, "10.0.0.7", 80]  # privileged port -> 10000 + p inside
    assert head["limits"] == {"nofile": 1024, "fsize": 1024**3}
    sigkill = await sandbox.exec(["x"], env={"CODE": "137"})
    assert sigkill.oom_killed  # a SIGKILL nobody sent


async def test_exec_timeout_kills_everything_in_the_pod(monkeypatch):
    sandbox, cluster = fake_sandbox(monkeypatch)
    result = await sandbox.exec(["hang"], env={}, timeout_s=0.2)
    assert result.killed and result.timed_out and result.exit_code is None
    assert cluster.killed and [h["op"] for h in cluster.heads] == ["run", "killall"]
    await sandbox.destroy()
    await sandbox.destroy()
    assert cluster.deleted == ["arena-sbx-abc"]
    with pytest.raises(SandboxError):
        await sandbox.exec(["echo"], env={})
