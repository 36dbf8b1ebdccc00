"""The Kubernetes manifests in deploy/k8s are valid: every resource against the official
Kubernetes JSON schemas (``kubernetes-validate``, which bundles them: no network, no
cluster), strictly (an unknown field is an error), for the oldest and the newest
Kubernetes version Arena supports; the kustomize overlays as rendered by
``kubectl kustomize`` when kubectl is installed; and Arena's own rules (limits, tokens,
non-root, RBAC scope, NATS as the official chart with JetStream and 3 replicas).

No cluster runs here: nothing is applied. See docs/kubernetes.md ("verified here / not run here").
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                         "(pip install kubernetes-validate): the manifests' schema cannot be checked")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
#: appArmorProfile (verification pods) is a field from 1.30 on.
VERSIONS = ("1.30.0", kv.latest_version())
NOT_MANIFESTS = {"kustomization.yaml", "values.yaml"}
KUSTOMIZATIONS = ("base", "overlays/dev", "overlays/prod")
WORKLOADS = {"Deployment", "StatefulSet"}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name not in NOT_MANIFESTS)


def docs_of(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def validate_all(docs: list[dict], where: str) -> None:
    problems = []
    for doc in docs:
        for version in VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                problems.append(f"{where}: {doc['kind']}/{doc['metadata']['name']} (k8s {version}) at {path}: "
                                f"{exc.message}")
            except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as exc:
                problems.append(f"{where}: {doc.get('kind')}: no schema ({exc})")
    assert problems == []


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_is_valid_against_the_kubernetes_schema(path: Path):
    docs = docs_of(path.read_text())
    assert docs, f"{path} holds no resource"
    validate_all(docs, str(path.relative_to(ROOT)))


def test_the_validator_rejects_what_it_should():
    """The check has teeth: an unknown field, a wrong type and a missing required field fail."""
    deployment = docs_of((K8S / "base" / "rollout.yaml").read_text())[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for bad in ({**container, "limitz": {}}, {**container, "ports": "9090"}, {k: v for k, v in container.items()
                                                                                  if k != "name"}):
        broken = {**deployment, "spec": {**deployment["spec"], "template": {**deployment["spec"]["template"],
                  "spec": {**deployment["spec"]["template"]["spec"], "containers": [bad]}}}}
        with pytest.raises(kv.ValidationError):
            kv.validate(broken, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomizations_name_files_that_exist(directory: str):
    kustomization = yaml.safe_load((K8S / directory / "kustomization.yaml").read_text())
    for entry in kustomization.get("resources", []):
        assert (K8S / directory / entry).exists(), f"{directory}: {entry} does not exist"


def rendered(directory: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays are not rendered (each file is still validated)")
    done = subprocess.run([kubectl, "kustomize", str(K8S / directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return docs_of(done.stdout)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_rendered_overlays_are_valid(directory: str):
    docs = rendered(directory)
    validate_all(docs, f"kubectl kustomize {directory}")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name in ("arena-rollout", "arena-trajectory", "arena-verification"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds
    assert ("StatefulSet", "arena-sandbox") in kinds and ("Service", "arena-sandbox") in kinds
    assert ("ConfigMap", "arena-config") in kinds
    assert {("Role", "arena-sandbox-worker"), ("RoleBinding", "arena-sandbox-worker")} <= kinds


def all_docs() -> list[dict]:
    return [d for p in manifest_files() for d in docs_of(p.read_text())]


def test_workloads_are_bounded_and_hardened():
    for doc in all_docs():
        if doc["kind"] not in WORKLOADS:
            continue
        pod = doc["spec"]["template"]["spec"]
        name = doc["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert "automountServiceAccountToken" in pod, f"{name}: token mounting must be explicit"
        assert pod["automountServiceAccountToken"] is (pod.get("serviceAccountName") == "arena-sandbox"), name
        for container in pod["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"], name
            assert ctx["readOnlyRootFilesystem"] is True, name


def test_every_service_reads_the_config_map_and_the_credentials_secret():
    for doc in all_docs():
        if doc["kind"] in WORKLOADS and doc["metadata"]["name"].startswith("arena-"):
            env_from = doc["spec"]["template"]["spec"]["containers"][0]["envFrom"]
            assert {"configMapRef": {"name": "arena-config"}} in env_from
            assert any(e.get("secretRef", {}).get("name") == "arena-credentials" for e in env_from)


def test_the_config_map_sets_every_arena_setting():
    from arena_core.settings import Settings

    config = next(d for d in all_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "arena-config")
    secret_ones = {"ARENA_JUDGE_KEY", "ARENA_CLICKHOUSE_URL"}  # from the Secret
    elsewhere = {"ARENA_SANDBOX_OWNER",  # the sandbox worker's pod name (sandbox.yaml)
                 "ARENA_DOCKER_URL"}  # the docker provider's: no engine on Kubernetes
    wanted = {k for k in Settings().to_env()} - secret_ones - elsewhere
    assert wanted - set(config["data"]) == set()
    Settings.from_env(config["data"])  # and the values parse


def test_the_sandbox_worker_may_only_manage_pods_and_policies_in_the_sandbox_namespace():
    docs = all_docs()
    roles = [d for d in docs if d["kind"] in {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}]
    assert all(d["kind"] in {"Role", "RoleBinding"} for d in roles), "no cluster-wide RBAC"
    role = next(d for d in roles if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "arena-sandboxes"
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == {("", "pods"), ("", "pods/exec"), ("networking.k8s.io", "networkpolicies")}
    binding = next(d for d in roles if d["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "arena-sandbox", "namespace": "arena"}]
    deny = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert deny["metadata"]["namespace"] == "arena-sandboxes" and deny["spec"]["podSelector"] == {}
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"} and "egress" not in deny["spec"]


def test_sandbox_pods_reach_only_the_rollout_services_proxy_only_port():
    """Agents get the rollout Service on its proxy-only port (ARENA_PROXY_PORT, which serves only
    /proxy/{rollout_id}/...): the Service maps it to the rollout container's port of that number,
    and the sandbox pods' NetworkPolicy (as the provider makes it from this config) allows that
    port of the rollout pods and nothing else: never the API's port."""
    from urllib.parse import urlsplit

    from arena_core.settings import Settings
    from arena_sandbox_providers.kubernetes_provider import KubernetesConfig, KubernetesProvider

    docs = all_docs()
    data = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "arena-config")["data"]
    settings = Settings.from_env(data)
    assert settings.proxy_port and settings.proxy_port != settings.rollout_port
    agents = urlsplit(settings.agent_url)
    assert agents.hostname == "arena-rollout.arena.svc.cluster.local" and agents.port == settings.proxy_port
    assert urlsplit(settings.public_url).port == settings.rollout_port  # the judge route: the API's port

    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "arena-rollout")
    ports = {p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"http": settings.rollout_port, "proxy": settings.proxy_port}
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "arena-rollout")
    (to_proxy,) = [p for p in service["spec"]["ports"] if p["port"] == agents.port]
    assert ports[to_proxy["targetPort"]] == settings.proxy_port

    config = KubernetesConfig.from_env(data, public_url=settings.agent_url)
    assert config.proxy_port == settings.proxy_port == int(data["ARENA_K8S_PROXY_PORT"])
    policy = KubernetesProvider(owner="arena-sandbox-0", config=config).policy()
    assert policy["metadata"]["namespace"] == data["ARENA_K8S_NAMESPACE"]
    (rule,) = policy["spec"]["egress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": settings.proxy_port}]
    selector = rule["to"][0]["podSelector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()  # the rollout pods
    assert rule["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": deployment["metadata"]["namespace"]}
    # the namespace's backstop denies the rest: the API's port is reachable by no policy
    deny = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert deny["metadata"]["namespace"] == data["ARENA_K8S_NAMESPACE"] and "egress" not in deny["spec"]
    assert all(p["port"] != settings.rollout_port for r in policy["spec"]["egress"] for p in r["ports"])


def test_nats_is_the_official_chart_clustered_with_jetstream():
    kustomization = yaml.safe_load((K8S / "nats" / "kustomization.yaml").read_text())
    (chart,) = kustomization["helmCharts"]
    assert chart["name"] == "nats" and chart["repo"] == "https://nats-io.github.io/k8s/helm/charts/"
    assert chart["releaseName"] == "nats" and chart["namespace"] == "arena"
    values = yaml.safe_load((K8S / "nats" / chart["valuesFile"]).read_text())
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["config"]["jetstream"]["fileStore"]["pvc"]["enabled"] is True


def test_every_workload_is_its_own_nats_user_with_its_password_from_the_secret():
    from urllib.parse import urlsplit

    from arena_stack import natsauth

    users = set()
    for doc in all_docs():
        if doc["kind"] not in WORKLOADS or not doc["metadata"]["name"].startswith("arena-"):
            continue
        user = doc["metadata"]["name"].removeprefix("arena-")
        env = doc["spec"]["template"]["spec"]["containers"][0]["env"]
        names = [e["name"] for e in env]
        # Kubernetes expands $(NATS_PASSWORD) only from a variable defined before the one using it
        assert names.index("NATS_PASSWORD") < names.index("ARENA_NATS_URL"), user
        secret = env[names.index("NATS_PASSWORD")]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": "arena-nats-users", "key": user}, "required (no optional), the user's own key"
        url = urlsplit(env[names.index("ARENA_NATS_URL")]["value"])
        assert (url.username, url.password, url.hostname) == (user, "$(NATS_PASSWORD)", "nats.arena.svc.cluster.local")
        assert user in natsauth.PERMISSIONS
        users.add(user)
    assert users == {"rollout", "trajectory", "sandbox", "verification", "dashboard"}


def test_nats_lets_in_only_arenas_users_each_with_its_own_permissions():
    from arena_stack import natsauth

    values = yaml.safe_load((K8S / "nats" / "values.yaml").read_text())
    authorization = values["config"]["merge"]["authorization"]
    assert set(authorization) == {"users"}, "no token, no user without a password, no default user"
    users = {u["user"]: u for u in authorization["users"]}
    assert set(users) == set(natsauth.PERMISSIONS)
    for name, (publish, subscribe) in natsauth.PERMISSIONS.items():
        permissions = users[name]["permissions"]
        assert permissions["publish"]["allow"] == publish and permissions["subscribe"]["allow"] == subscribe, name
        assert "deny" not in permissions["publish"], "deny by omission: what natsauth does not allow"
        # the password: a variable of nats-server's environment, which the chart fills from the Secret
        variable = natsauth.env_name(name)
        assert users[name]["password"] == f"<< ${variable} >>"
        assert values["container"]["env"][variable] == {
            "valueFrom": {"secretKeyRef": {"name": "arena-nats-users", "key": name}}}


def test_the_generated_nats_configurations_are_up_to_date():
    """compose's nats-server.conf and these Helm values hold natsauth's users as `python -m
    arena_stack.natsauth write` renders them (`check` exits 1 on drift)."""
    from arena_stack import natsauth

    assert natsauth.main(["check"]) == 0, "run: python -m arena_stack.natsauth write"


def test_the_topology_job_makes_the_streams_as_the_administrator():
    """The services' users may not create streams: the arena-topology Job does, as admin, before them."""
    (job,) = [d for d in all_docs() if d["kind"] == "Job" and d["metadata"]["name"] == "arena-topology"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "arena_stack.topology"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "arena-nats-users", "key": "admin"}
    assert env["ARENA_NATS_URL"]["value"].startswith("nats://admin:$(NATS_PASSWORD)@")
    assert pod["securityContext"]["runAsNonRoot"] is True and container["securityContext"]["readOnlyRootFilesystem"]
    assert "topology.yaml" in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"]


def test_the_dev_overlay_makes_a_password_for_every_nats_user():
    from arena_stack import natsauth

    kustomization = yaml.safe_load((K8S / "overlays" / "dev" / "kustomization.yaml").read_text())
    (secret,) = [s for s in kustomization["secretGenerator"] if s["name"] == "arena-nats-users"]
    made = dict(literal.split("=", 1) for literal in secret["literals"])
    assert set(made) == set(natsauth.PERMISSIONS) and all(made.values())
    assert len(set(made.values())) == len(made), "a password per user"
