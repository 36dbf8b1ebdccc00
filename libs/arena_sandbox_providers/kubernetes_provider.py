"""The ``kubernetes`` provider: one Pod per sandbox, through the official ``kubernetes`` client.

**Not run against a cluster**: no cluster runs where this was written. The spec builders
(:func:`pod_spec`, :func:`network_policy`, :func:`owner_labels`) are pure and unit-tested
(tests/sandbox_providers/test_kubernetes_pod_specs.py, also against the Kubernetes JSON
schema); the I/O below (create, exec over the pods/exec WebSocket, tar over exec, delete,
reap) has not been exercised against a real API server. See docs/kubernetes.md.

How a sandbox maps onto Kubernetes:

- a Pod (``restartPolicy: Never``, no service-account token, non-root, no privilege
  escalation, every capability dropped, read-only root, ``RuntimeDefault`` seccomp,
  requests = limits from :class:`SandboxLimits`) whose init only reaps zombies;
  ``/sandbox`` and ``/run/arena`` are ``emptyDir`` volumes, ``/tmp`` a memory ``emptyDir``;
- one NetworkPolicy per owner selecting its sandbox pods: no ingress (exec reaches the
  pod through the API server and the kubelet, not the pod network), egress only to the
  proxy pods (a pod selector in the proxy's namespace, or CIDRs) on the proxy's port: the
  rollout service's proxy-only port (``ARENA_PROXY_PORT``), which serves only the agents'
  proxy routes, since a relay in the pod could not confine the agent (docs/kubernetes.md);
  no DNS: the worker resolves the proxy's host and the in-pod relay dials the address;
- every operation is an exec of ``python3 -I -S -c HELPER`` (stdlib only, inline: no file
  in the pod to tamper with) that reads one JSON header line (plus a payload) from stdin:
  ``run`` (the command with its environment, rlimits and the loopback relay to the proxy;
  when its first process exits, every other process in the pod but the init is SIGKILLed),
  ``put`` (a tar archive, extracted as the sandbox user), ``read``, ``exists``, ``killall``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import socket
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from arena_core import sources
from arena_core.settings import SettingsError
from arena_sandbox_providers import local, priority
from arena_sandbox_providers.local import DIFF_EXCLUDES, GIT_IDENTITY, ProxyForward
from arena_sandbox_providers.provider import (
    LABEL,
    OWNER_LABEL,
    CreateSpec,
    ExecResult,
    OutputCallback,
    SandboxError,
    SandboxLimits,
)

log = logging.getLogger("arena.sandbox.kubernetes")

DEFAULT_IMAGE = "arena/agent-base:latest"
DEFAULT_NAMESPACE = "arena-sandboxes"
SANDBOX_UID = 1000
CONTAINER = "sandbox"
ID_LABEL = "arena.sandbox_id"
MANAGED_BY = {"app.kubernetes.io/managed-by": "arena-sandbox"}
#: Pods of the rollout service (the LLM proxy), as the chart in deploy/k8s labels them.
DEFAULT_PROXY_LABELS = {"app.kubernetes.io/name": "arena-rollout"}
#: Their namespace when neither ARENA_K8S_PROXY_NAMESPACE nor the worker's own (in-cluster) is known.
DEFAULT_PROXY_NAMESPACE = "arena"
#: The pod's init: PID 1, reaps what exec'd commands leave (orphans are re-parented to it),
#: ignores SIGTERM (a PID-namespace init without a handler does); the pod is deleted with
#: grace period 0, so the kubelet SIGKILLs it.
INIT = ["python3", "-I", "-S", "-c",
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        while os.waitpid(-1, os.WNOHANG)[0]:\n"
        "            pass\n"
        "    except ChildProcessError:\n"
        "        pass\n"
        "    time.sleep(0.5)\n"]
_SIGKILL_EXIT = 137
_NOT_FOUND_EXIT = 3
_KILL_GRACE_S = 10.0
_CHUNK = 256 * 1024
_FATAL_WAITING = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                  "CreateContainerError", "RunContainerError", "ErrImageNeverPull"}
_RESERVED = ("/sandbox", "/run/arena", "/proc", "/sys", "/dev", "/tmp", "/etc", "/usr", "/bin", "/lib", "/sbin")

# ----------------------------------------------------------------------------- in-pod helper

#: Stdlib-only, Python 3.6+; run as ``python3 -I -S -c HELPER`` by the sandbox user (the pod's
#: ``runAsUser``). Reads one JSON line from stdin, then acts (module docstring).
HELPER = r'''
import json, os, resource, signal, socket, stat, subprocess, sys, tarfile, threading
inp = sys.stdin.buffer
head = json.loads(inp.readline().decode())
op = head["op"]

def kill_all():
    if os.getuid() == 0:  # never as root (the pod runs as uid 1000): kill(-1) would reach the whole host
        return
    try:
        os.kill(-1, signal.SIGKILL)  # every process this uid may signal but PID 1 and this one
    except OSError:
        pass

def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

def serve(client, target):
    try:
        upstream = socket.create_connection(target, timeout=30)
        upstream.settimeout(None)
    except OSError as exc:
        sys.stderr.write("arena relay: cannot reach the proxy: %s\n" % exc)
        client.close()
        return
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()

def accept_loop(listener, target):
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(client, target), daemon=True).start()

def relay(port, host, target_port):
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError:
            if family == socket.AF_INET:
                raise
            listener.close()
            continue
        listener.listen(128)
        threading.Thread(target=accept_loop, args=(listener, (host, target_port)), daemon=True).start()

if op == "run":
    if head.get("relay"):
        relay(*head["relay"])
    env = dict(os.environ)
    env.update(head["env"])
    limits = head.get("limits") or {}
    def prepare():
        for name, value in (("RLIMIT_NOFILE", limits.get("nofile")), ("RLIMIT_FSIZE", limits.get("fsize")),
                            ("RLIMIT_CORE", 0)):
            if value is not None:
                resource.setrlimit(getattr(resource, name), (value, value))
        os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        child = subprocess.Popen(head["argv"], env=env, cwd=head["cwd"], stdin=devnull, preexec_fn=prepare)
    except OSError as exc:
        sys.stderr.write("arena: cannot run %r: %s\n" % (head["argv"][0], exc))
        sys.stderr.flush()
        kill_all()
        os._exit(127)
    code = child.wait()
    sys.stdout.flush()
    kill_all()
    os._exit(128 - code if code < 0 else code)
elif op == "put":
    data = inp.read(head["size"])
    with tarfile.open(fileobj=__import__("io").BytesIO(data), mode="r:") as archive:
        if hasattr(tarfile, "tar_filter"):
            archive.extractall("/", filter="tar")
        else:
            archive.extractall("/")
elif op == "read":
    try:
        fd = os.open(head["path"], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        os._exit(3)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os._exit(3)
    with os.fdopen(fd, "rb") as fh:
        sys.stdout.buffer.write(fh.read(head["max"] + 1))
        sys.stdout.flush()
elif op == "exists":
    os._exit(0 if os.path.lexists(head["path"]) else 3)
elif op == "killall":
    kill_all()
'''

# ----------------------------------------------------------------------------- pure spec builders


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value (<= 63 characters of ``[A-Za-z0-9_.-]``, alphanumeric
    at both ends); a value that had to be changed gets a hash suffix, so two owners never share one."""
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", text).strip("-_.")
    if clean == text and 0 < len(clean) <= 63:
        return clean
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{clean[:54].rstrip('-_.')}-{digest}".lstrip("-")


def dns_label(text: str) -> str:
    """``text`` as an RFC 1123 label (object names): lower case, ``[a-z0-9-]``, <= 63."""
    clean = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")
    if clean == text and 0 < len(clean) <= 63:
        return clean
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{clean[:54].rstrip('-')}-{digest}".lstrip("-")


def owner_labels(owner: str) -> dict[str, str]:
    """The labels that select every sandbox pod of ``owner`` (reaping, the NetworkPolicy)."""
    return {LABEL: "1", OWNER_LABEL: label_value(owner)}


def _quantity_cpu(cpus: float) -> str:
    return f"{max(1, round(cpus * 1000))}m"


def check_workspace_mount(path: str) -> None:
    """The same rule as the docker provider's: an absolute path outside Arena's and the system's."""
    if not path:
        return
    norm = os.path.normpath(path)
    if not norm.startswith("/") or norm == "/" or any(norm == r or norm.startswith(r + "/") for r in _RESERVED):
        raise SandboxError(f"cannot mount the workspace at {path!r}: an absolute path outside Arena's and the "
                           "system's directories is needed (e.g. /testbed)")


def pod_spec(
    *,
    name: str,
    namespace: str,
    owner: str,
    sandbox_id: str,
    image: str,
    limits: SandboxLimits = SandboxLimits(),
    workspace_bytes: int = 10 * 1024**3,
    workspace_mount: str = "",
    active_deadline_s: int | None = None,
    runtime_class: str = "",
    node_selector: Mapping[str, str] | None = None,
    image_pull_secrets: tuple[str, ...] = (),
    image_pull_policy: str = "IfNotPresent",
    nice: int = 0,
) -> dict[str, Any]:
    """The Pod manifest of one sandbox (a plain dict: the client accepts it as the body).

    Requests equal limits for memory and ephemeral storage (the ``/sandbox`` volume plus 1 GiB
    for the container's own layer and logs). CPU: the limit is ``limits.cpus``; the request is
    that over the weight factor of ``nice`` (:mod:`.priority`; nice 10: about a tenth), so a
    waiting agent reserves little of a node (the scheduler packs sandboxes by memory) and weighs
    less than Arena's own pods when the node's CPU is contended (the kubelet sets a pod's CPU
    weight from its request). ``nice`` 0: requests equal limits (Guaranteed QoS). ``/tmp`` is a
    memory ``emptyDir`` of ``limits.tmp_bytes`` (counted against the memory limit, as the
    docker provider's tmpfs). No per-pod pids field exists: the kubelet's ``podPidsLimit``
    bounds processes; open files and file size are rlimits set by the helper per command.
    """
    check_workspace_mount(workspace_mount)
    memory = str(int(limits.memory_bytes))
    cpu = _quantity_cpu(limits.cpus)
    storage = str(int(workspace_bytes) + 1024**3)
    resources = {"cpu": cpu, "memory": memory, "ephemeral-storage": storage}
    requests = {**resources, "cpu": _quantity_cpu(limits.cpus * priority.cpu_shares(nice) / 1024)}
    mounts: list[dict[str, Any]] = [
        {"name": "sandbox", "mountPath": "/sandbox"},
        {"name": "run", "mountPath": local.RUN_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if workspace_mount:
        mounts.append({"name": "sandbox", "mountPath": os.path.normpath(workspace_mount), "subPath": "workspace"})
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "shareProcessNamespace": False,
        "hostname": "sandbox",
        "terminationGracePeriodSeconds": 0,
        "securityContext": {
            "runAsUser": SANDBOX_UID,
            "runAsGroup": SANDBOX_UID,
            "runAsNonRoot": True,
            "fsGroup": SANDBOX_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [{
            "name": CONTAINER,
            "image": image,
            "imagePullPolicy": image_pull_policy,
            "command": list(INIT),
            "workingDir": local.WORKSPACE,
            "env": [{"name": "HOME", "value": "/tmp"}],
            "resources": {"limits": dict(resources), "requests": requests},
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "privileged": False,
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
                "runAsUser": SANDBOX_UID,
                "runAsGroup": SANDBOX_UID,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": mounts,
        }],
        "volumes": [
            {"name": "sandbox", "emptyDir": {"sizeLimit": str(int(workspace_bytes))}},
            {"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": str(1024**2)}},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": str(int(limits.tmp_bytes))}},
        ],
    }
    if active_deadline_s:
        spec["activeDeadlineSeconds"] = int(active_deadline_s)
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**owner_labels(owner), ID_LABEL: sandbox_id, **MANAGED_BY},
            "annotations": {OWNER_LABEL: owner},
        },
        "spec": spec,
    }


def network_policy(
    *,
    namespace: str,
    owner: str,
    proxy_port: int,
    proxy_labels: Mapping[str, str] | None = None,
    proxy_namespace: str = "",
    proxy_cidrs: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The NetworkPolicy of ``owner``'s sandbox pods: no ingress; egress only to the proxy.

    The proxy is the pods matching ``proxy_labels`` in ``proxy_namespace`` (a Service's
    ClusterIP is translated to those pods before the policy applies, so ``proxy_port`` is
    the pods' port) and/or ``proxy_cidrs`` (a proxy outside the cluster), on TCP
    ``proxy_port``. No DNS: the worker resolves the proxy's host itself. Enforced only by a
    CNI that implements NetworkPolicy (Calico, Cilium, ...).
    """
    if not 0 < int(proxy_port) < 65536:
        raise ValueError(f"proxy port {proxy_port} is not a TCP port")
    peers: list[dict[str, Any]] = []
    if proxy_labels:
        peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(proxy_labels)}}
        if proxy_namespace:
            peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": proxy_namespace}}
        peers.append(peer)
    peers.extend({"ipBlock": {"cidr": cidr}} for cidr in proxy_cidrs)
    if not peers:
        raise ValueError("the proxy needs a pod selector or a CIDR")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": dns_label(f"arena-sandbox-{owner}"),
            "namespace": namespace,
            "labels": {**owner_labels(owner), **MANAGED_BY},
            "annotations": {OWNER_LABEL: owner},
        },
        "spec": {
            "podSelector": {"matchLabels": owner_labels(owner)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [{"to": peers, "ports": [{"protocol": "TCP", "port": int(proxy_port)}]}],
        },
    }


def sandbox_path(path: str) -> str:
    """``path`` normalised, if it is under ``/sandbox/{workspace,.arena,agent}`` (else SandboxError)."""
    norm = os.path.normpath(path)
    parts = Path(norm).parts
    if len(parts) < 3 or parts[:2] != ("/", "sandbox") or parts[2] not in ("workspace", ".arena", "agent") \
            or ".." in parts:
        raise SandboxError(f"{path!r} is not under /sandbox/{{workspace,.arena,agent}}")
    return norm


def tar_of_files(files: Mapping[str, bytes], *, dirs: tuple[str, ...] = ()) -> bytes:
    """An uncompressed tar with ``dirs`` (mode 0755) and ``files`` (0644) at their absolute paths."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        for d in dirs:
            info = tarfile.TarInfo(d.lstrip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            archive.addfile(info)
        for path, data in files.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tar_of_dir(src: Path, dest: str) -> bytes:
    """An uncompressed tar of the host directory ``src`` placed at ``dest`` (links kept as links)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        archive.add(str(src), arcname=dest.lstrip("/"), recursive=True)
    return buf.getvalue()


# ----------------------------------------------------------------------------- settings


class KubernetesConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The provider's settings; :meth:`from_env` reads them from ``ARENA_K8S_*`` (docs/kubernetes.md)."""

    namespace: str = DEFAULT_NAMESPACE
    kubeconfig: str = ""  # "" = in-cluster when KUBERNETES_SERVICE_HOST is set, else ~/.kube/config
    context: str = ""
    proxy_port: int = 9090
    proxy_labels: dict[str, str] = msgspec.field(default_factory=lambda: dict(DEFAULT_PROXY_LABELS))
    proxy_namespace: str = ""  # "" = the worker's own namespace (in-cluster), else DEFAULT_PROXY_NAMESPACE
    proxy_cidrs: tuple[str, ...] = ()
    runtime_class: str = ""
    node_selector: dict[str, str] = {}
    image_pull_secrets: tuple[str, ...] = ()
    workspace_bytes: int = 10 * 1024**3
    start_timeout_s: float = 300.0

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, public_url: str = "") -> KubernetesConfig:
        def pairs(var: str) -> dict[str, str]:
            out = {}
            for item in filter(None, (p.strip() for p in env.get(var, "").split(","))):
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise SettingsError(f"{var}: {item!r} is not key=value")
                out[key.strip()] = value.strip()
            return out

        def number(var: str, default: float, kind=int):
            raw = env.get(var, "")
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise SettingsError(f"{var}={raw!r} is not a number") from None
            if value <= 0:
                raise SettingsError(f"{var}={raw!r} must be positive")
            return value

        url = urlsplit(public_url) if public_url else None
        default_port = (url.port or (443 if url.scheme == "https" else 80)) if url and url.hostname else 9090
        proxy_labels = pairs("ARENA_K8S_PROXY_SELECTOR") or dict(DEFAULT_PROXY_LABELS)
        port = number("ARENA_K8S_PROXY_PORT", default_port)
        if port >= 65536:
            raise SettingsError(f"ARENA_K8S_PROXY_PORT={port} is not a TCP port")
        return cls(
            namespace=env.get("ARENA_K8S_NAMESPACE") or DEFAULT_NAMESPACE,
            kubeconfig=env.get("ARENA_K8S_KUBECONFIG", ""),
            context=env.get("ARENA_K8S_CONTEXT", ""),
            proxy_port=port,
            proxy_labels=proxy_labels,
            proxy_namespace=env.get("ARENA_K8S_PROXY_NAMESPACE", ""),
            proxy_cidrs=tuple(c.strip() for c in env.get("ARENA_K8S_PROXY_CIDRS", "").split(",") if c.strip()),
            runtime_class=env.get("ARENA_K8S_RUNTIME_CLASS", ""),
            node_selector=pairs("ARENA_K8S_NODE_SELECTOR"),
            image_pull_secrets=tuple(s.strip() for s in env.get("ARENA_K8S_IMAGE_PULL_SECRETS", "").split(",")
                                     if s.strip()),
            workspace_bytes=number("ARENA_K8S_WORKSPACE_BYTES", 10 * 1024**3),
            start_timeout_s=number("ARENA_K8S_START_TIMEOUT_S", 300.0, float),
        )


def _own_namespace() -> str:
    with contextlib.suppress(OSError):
        return Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
    return ""


# ----------------------------------------------------------------------------- I/O


class KubernetesSandbox:
    provider = "kubernetes"

    def __init__(self, sandbox_id: str, pod: str, provider: KubernetesProvider, limits: SandboxLimits):
        self.id = sandbox_id
        self.pod = pod
        self._provider = provider
        self._limits = limits
        self._lock = asyncio.Lock()
        self._destroyed = False

    # ----------------------------------------------------------- the helper over exec

    def _call(self, head: dict[str, Any], payload: bytes = b"", on_stdout: Callable[[bytes], None] | None = None,
              on_stderr: Callable[[bytes], None] | None = None, stop: threading.Event | None = None) -> int | None:
        """One exec of the helper (blocking; run in a thread): the exit code, or ``None`` if
        ``stop`` was set before it ended. Raises SandboxError if the stream ends without a status."""
        if self._destroyed:
            raise SandboxError("the sandbox was destroyed")
        ws = self._provider.open_exec(self.pod, ["python3", "-I", "-S", "-c", HELPER])
        try:
            ws.write_stdin(json.dumps(head).encode() + b"\n")
            for start in range(0, len(payload), _CHUNK):
                ws.write_stdin(payload[start:start + _CHUNK])
            while ws.is_open():
                ws.update(timeout=0.2)
                for channel, sink in ((1, on_stdout), (2, on_stderr)):
                    data = ws.read_channel(channel, timeout=0)
                    if data and sink is not None:
                        sink(data)
                if stop is not None and stop.is_set():
                    return None
            for channel, sink in ((1, on_stdout), (2, on_stderr)):
                data = ws.read_channel(channel, timeout=0)
                if data and sink is not None:
                    sink(data)
            try:
                code = ws.returncode
            except Exception as exc:  # noqa: BLE001 - no parsable status: the pod or the stream died
                raise SandboxError(f"pod {self.pod}: the exec stream ended without a status ({exc})") from exc
            if code is None:
                raise SandboxError(f"pod {self.pod}: the exec stream ended without a status")
            return int(code)
        finally:
            with contextlib.suppress(Exception):
                ws.close()

    async def _simple(self, head: dict[str, Any], payload: bytes = b"") -> tuple[int, bytes, bytes]:
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            code = await asyncio.to_thread(self._call, head, payload, out.append, err.append)
        except SandboxError:
            raise
        except Exception as exc:  # noqa: BLE001 - ApiException, WebSocket errors
            raise SandboxError(f"pod {self.pod}: {exc}") from exc
        return int(code if code is not None else -1), b"".join(out), b"".join(err)

    async def _put(self, archive: bytes) -> None:
        code, _, err = await self._simple({"op": "put", "size": len(archive)}, archive)
        if code != 0:
            raise SandboxError(f"pod {self.pod}: extracting files failed (exit {code}): "
                               f"{err.decode(errors='replace')[-1000:]}")

    # ----------------------------------------------------------- Sandbox interface

    async def put_dir(self, src: Path, dest: str, *, src_stable: bool = False) -> None:
        archive = await asyncio.to_thread(tar_of_dir, Path(src), sandbox_path(dest))
        await self._put(archive)

    async def put_files(self, files: Mapping[str, bytes]) -> None:
        checked = {sandbox_path(p): data for p, data in files.items()}
        parents = tuple(sorted({os.path.dirname(p) for p in checked}))
        await self._put(tar_of_files(checked, dirs=parents))

    async def read_file(self, path: str, *, max_bytes: int) -> bytes | None:
        code, out, _ = await self._simple({"op": "read", "path": sandbox_path(path), "max": int(max_bytes)})
        return out[: max_bytes + 1] if code == 0 else None

    async def exists(self, path: str) -> bool:
        code, _, _ = await self._simple({"op": "exists", "path": sandbox_path(path)})
        return code == 0

    async def _kill_all(self) -> None:
        with contextlib.suppress(SandboxError):
            await self._simple({"op": "killall"})

    async def _run(self, head: dict[str, Any], timeout_s: float, cancel: asyncio.Event | None,
                   on_stdout: OutputCallback, on_stderr: OutputCallback) -> tuple[int | None, bool]:
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def forward(sink: OutputCallback) -> Callable[[bytes], None]:
            return lambda chunk: loop.call_soon_threadsafe(sink, chunk)

        task = asyncio.ensure_future(asyncio.to_thread(self._call, head, b"", forward(on_stdout), forward(on_stderr),
                                                       stop))
        waiters: set[asyncio.Future] = {task}
        if cancel is not None:
            waiters.add(asyncio.ensure_future(cancel.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            killed = not task.done()
            if killed:
                await self._kill_all()
                try:
                    await asyncio.wait_for(asyncio.shield(task), _KILL_GRACE_S)
                except asyncio.TimeoutError:
                    log.warning("sandbox %s: the command did not end after killall; abandoning its stream", self.id)
                    stop.set()
            try:
                return await task, killed
            except SandboxError:
                if killed:
                    return None, True
                raise
        finally:
            for waiter in waiters:
                if waiter is not task:
                    waiter.cancel()
            if not task.done():  # we were cancelled: never leave the command running
                stop.set()
                await asyncio.shield(self.destroy())

    async def exec(
        self,
        command: list[str],
        *,
        env: Mapping[str, str],
        workdir: str = local.WORKSPACE,
        timeout_s: float = 600.0,
        proxy: ProxyForward | None = None,
        cancel: asyncio.Event | None = None,
        on_output: OutputCallback | None = None,
    ) -> ExecResult:
        local.validate_env(dict(env))
        if cancel is not None and cancel.is_set():
            return ExecResult(exit_code=None, killed=True)
        sink = on_output or (lambda chunk: None)
        head: dict[str, Any] = {"op": "run", "argv": list(command), "env": dict(env), "cwd": workdir,
                                "limits": {"nofile": self._limits.open_files, "fsize": self._limits.file_size_bytes}}
        if proxy is not None:
            address = await self._provider.resolve(proxy.host, proxy.port)
            head["relay"] = [proxy.inside_port, address, proxy.port]
        async with self._lock:
            started = time.monotonic()
            try:
                code, killed = await self._run(head, timeout_s, cancel, sink, sink)
            except SandboxError as exc:
                if self._destroyed:
                    raise SandboxError(f"kubernetes sandbox {self.id} was destroyed while the command ran") from exc
                if await self._provider.oom_killed(self.pod):
                    return ExecResult(exit_code=_SIGKILL_EXIT, oom_killed=True, duration_s=time.monotonic() - started)
                raise
            duration = time.monotonic() - started
            if killed:
                timed_out = not (cancel is not None and cancel.is_set())
                return ExecResult(exit_code=None, timed_out=timed_out, killed=True, duration_s=duration)
            # No per-command OOM counter is visible through the API: a SIGKILL nobody sent is the OOM killer.
            return ExecResult(exit_code=code, oom_killed=code == _SIGKILL_EXIT, duration_s=duration)

    async def diff(self, base: str, *, timeout_s: float = 120.0, put_at_base: bool = False,
                   max_bytes: int | None = None) -> str:
        out = sources.BoundedBytes(max_bytes)  # streamed: at most max_bytes held
        err = sources.BoundedBytes(64 * 1024)
        env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/tmp",
               "GIT_NO_REPLACE_OBJECTS": "1", **GIT_IDENTITY}
        head = {"op": "run", "argv": ["sh", "-c", local._DIFF_SCRIPT, "sh", base, *local._exclude_pathspecs()],
                "env": env, "cwd": local.WORKSPACE, "limits": {}}
        async with self._lock:
            try:
                code, killed = await self._run(head, timeout_s, None, out, err)
            except SandboxError as exc:
                raise local.GitError(f"git diff could not run: {exc}") from exc
        if killed:
            raise local.GitError(f"git diff timed out after {timeout_s:.0f}s")
        if code != 0:
            detail = err.data().decode(errors="replace").strip()[-2000:]
            raise local.GitError(f"git diff failed (exit {code}): {detail}")
        return out.diff()

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        await asyncio.shield(self._provider.delete_pod(self.pod))


class KubernetesProvider:
    """Pods in ``config.namespace`` through the Kubernetes API (in-cluster or a kubeconfig)."""

    name = "kubernetes"
    uses_host_memory = False

    def __init__(self, *, owner: str, config: KubernetesConfig = KubernetesConfig(),
                 default_image: str = DEFAULT_IMAGE, max_wall_clock_s: int = 86400, nice: int = 0):
        self.owner = owner
        #: the pods' CPU request below their limit (:func:`pod_spec`, ``ARENA_SANDBOX_NICE``)
        self.nice = nice
        self.config = config
        self.default_image = default_image
        # Backstop only (the worker kills on the wall clock): the longest budget plus the
        # time a warm pod may wait in the pool and the diff.
        self.active_deadline_s = int(max_wall_clock_s) + 3600
        self._api_client = None
        self._core = None
        self._stream_lock = threading.Lock()
        self._policy_lock = asyncio.Lock()
        self._policy_applied = False

    # ----------------------------------------------------------- client

    @property
    def core(self):
        if self._core is None:
            from kubernetes import client, config

            cfg = client.Configuration()
            if not self.config.kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=cfg)
            else:
                config.load_kube_config(config_file=self.config.kubeconfig or None,
                                        context=self.config.context or None, client_configuration=cfg)
            self._api_client = client.ApiClient(cfg)
            self._core = client.CoreV1Api(self._api_client)
        return self._core

    def open_exec(self, pod: str, command: list[str]):
        """A WebSocket exec session (stdin, stdout, stderr, binary) in the pod's sandbox container."""
        from kubernetes.stream import stream

        core = self.core
        # ``stream`` swaps the ApiClient's transport while it connects: one connect at a time.
        with self._stream_lock:
            return stream(core.connect_get_namespaced_pod_exec, pod, self.config.namespace, container=CONTAINER,
                          command=command, stdin=True, stdout=True, stderr=True, tty=False,
                          _preload_content=False, binary=True)

    async def resolve(self, host: str, port: int) -> str:
        """The proxy's address as the pod dials it (pods have no DNS egress)."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise SandboxError(f"cannot resolve the proxy host {host!r}: {exc}") from exc
        infos.sort(key=lambda i: i[0] != socket.AF_INET)
        return infos[0][4][0]

    # ----------------------------------------------------------- provider interface

    async def health(self) -> str | None:
        def probe() -> str | None:
            try:
                self.core.list_namespaced_pod(self.config.namespace, limit=1)
            except Exception as exc:  # noqa: BLE001 - any failure is the reason
                return f"no Kubernetes API for namespace {self.config.namespace}: {exc}"
            return None

        return await asyncio.to_thread(probe)

    def pool_key(self, spec: CreateSpec) -> CreateSpec:
        return CreateSpec(image=spec.image or self.default_image, limits=spec.limits,
                          workspace_mount=spec.workspace_mount)

    def policy(self) -> dict[str, Any]:
        return network_policy(namespace=self.config.namespace, owner=self.owner, proxy_port=self.config.proxy_port,
                              proxy_labels=self.config.proxy_labels,
                              proxy_namespace=self.config.proxy_namespace or _own_namespace() or DEFAULT_PROXY_NAMESPACE,
                              proxy_cidrs=self.config.proxy_cidrs)

    async def ensure_policy(self) -> None:
        """Create (or replace) this owner's NetworkPolicy before its first pod."""
        async with self._policy_lock:
            if self._policy_applied:
                return
            body = self.policy()

            def apply() -> None:
                from kubernetes import client
                from kubernetes.client.rest import ApiException

                net = client.NetworkingV1Api(self._api_client_or_init())
                try:
                    net.create_namespaced_network_policy(self.config.namespace, body)
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    net.replace_namespaced_network_policy(body["metadata"]["name"], self.config.namespace, body)

            try:
                await asyncio.to_thread(apply)
            except Exception as exc:  # noqa: BLE001
                raise SandboxError(f"cannot apply the sandbox NetworkPolicy: {exc}") from exc
            self._policy_applied = True

    def _api_client_or_init(self):
        _ = self.core
        return self._api_client

    async def create(self, spec: CreateSpec) -> KubernetesSandbox:
        await self.ensure_policy()
        sandbox_id = uuid.uuid4().hex[:12]
        name = f"arena-sbx-{sandbox_id}"
        body = pod_spec(name=name, namespace=self.config.namespace, owner=self.owner, sandbox_id=sandbox_id,
                        image=spec.image or self.default_image, limits=spec.limits,
                        workspace_bytes=self.config.workspace_bytes, workspace_mount=spec.workspace_mount,
                        active_deadline_s=self.active_deadline_s, runtime_class=self.config.runtime_class,
                        node_selector=self.config.node_selector, image_pull_secrets=self.config.image_pull_secrets,
                        nice=self.nice)
        made = asyncio.ensure_future(asyncio.to_thread(self.core.create_namespaced_pod, self.config.namespace, body))
        try:
            await asyncio.shield(made)
            await self._wait_running(name)
            sandbox = KubernetesSandbox(sandbox_id, name, self, spec.limits)
            await sandbox._put(tar_of_files({f"{local.RUN_DIR}/excludes": "".join(f"{p}\n" for p in DIFF_EXCLUDES)
                                             .encode()},
                                            dirs=(local.WORKSPACE, local.ARENA_DIR, local.AGENT_DIR)))
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await made
            await asyncio.shield(self.delete_pod(name))
            if isinstance(exc, (SandboxError, asyncio.CancelledError)):
                raise
            if isinstance(exc, Exception):
                raise SandboxError(f"cannot start a {body['spec']['containers'][0]['image']} pod: {exc}") from exc
            raise
        return sandbox

    async def _wait_running(self, name: str) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            pod = await asyncio.to_thread(self.core.read_namespaced_pod, name, self.config.namespace)
            phase = pod.status.phase if pod.status else None
            statuses = (pod.status.container_statuses or []) if pod.status else []
            if phase in ("Failed", "Succeeded"):
                raise SandboxError(f"pod {name} ended before use ({phase}): {pod.status.reason or ''} "
                                   f"{pod.status.message or ''}".strip())
            for status in statuses:
                waiting = status.state.waiting if status.state else None
                if waiting is not None and waiting.reason in _FATAL_WAITING:
                    raise SandboxError(f"pod {name}: {waiting.reason}: {waiting.message or ''}".strip())
                if status.state and status.state.running is not None and phase == "Running":
                    return
            if time.monotonic() > deadline:
                raise SandboxError(f"pod {name} not running after {self.config.start_timeout_s:.0f}s (phase {phase})")
            await asyncio.sleep(0.25)

    async def oom_killed(self, pod: str) -> bool:
        """Whether the pod's container was OOM-killed (the init died with it: the pod is over)."""
        def read() -> bool:
            status = self.core.read_namespaced_pod(pod, self.config.namespace).status
            for cs in (status.container_statuses or []) if status else []:
                term = cs.state.terminated if cs.state else None
                if term is not None and term.reason == "OOMKilled":
                    return True
            return False

        try:
            return await asyncio.to_thread(read)
        except Exception:  # noqa: BLE001 - unknown: not an OOM we can report
            return False

    async def delete_pod(self, name: str) -> None:
        """Delete the pod at once (grace period 0: the kubelet SIGKILLs it). Never raises."""
        def delete() -> None:
            from kubernetes.client.rest import ApiException

            try:
                self.core.delete_namespaced_pod(name, self.config.namespace, grace_period_seconds=0,
                                                propagation_policy="Background")
            except ApiException as exc:
                if exc.status != 404:
                    raise

        try:
            await asyncio.to_thread(delete)
        except Exception as exc:  # noqa: BLE001 - destroy never raises; reap_orphans catches leftovers
            log.warning("could not delete pod %s: %s", name, exc)

    async def reap_orphans(self) -> int:
        selector = ",".join(f"{k}={v}" for k, v in owner_labels(self.owner).items())
        pods = await asyncio.to_thread(self.core.list_namespaced_pod, self.config.namespace, label_selector=selector)
        names = [p.metadata.name for p in pods.items]
        for name in names:
            await self.delete_pod(name)
        if names:
            log.warning("reaped %d orphaned pod(s) of owner %s", len(names), self.owner)
        await self.ensure_policy()
        return len(names)

    async def close(self) -> None:
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                self._api_client.close()
