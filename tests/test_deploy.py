"""The deployment files are safe to share: Ray's token auth on, secrets only from an
env file or a Secret, Grafana without anonymous access or a default password,
Prometheus with the read-only metrics token, non-root pods on read-only root
filesystems, and networks that let only the API reach the store and Ray's client port."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
DEPLOY = ROOT / "deploy"


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _k8s() -> list[dict]:
    docs: list[dict] = []
    for path in sorted((DEPLOY / "kuberay").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _pod_specs(docs: list[dict]) -> list[dict]:
    specs = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    for ray in (d for d in docs if d["kind"] == "RayCluster"):
        specs.append(ray["spec"]["headGroupSpec"]["template"]["spec"])
        specs += [g["template"]["spec"] for g in ray["spec"]["workerGroupSpecs"]]
    return specs


def test_compose_takes_every_secret_from_the_env_file():
    text = (DEPLOY / "compose.yaml").read_text()
    example = (DEPLOY / "secrets.env.example").read_text()
    needed = set(re.findall(r"\$\{(\w+):\?", text))
    needed |= {s["environment"] for s in _compose()["secrets"].values()}
    offered = set(re.findall(r"^(\w+)=", example, re.MULTILINE))
    assert needed <= offered, needed - offered
    assert "deploy/secrets.env" in (ROOT / ".gitignore").read_text()
    for name, service in _compose()["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"PASSWORD|TOKEN|DATABASE_URL", key) and not key.endswith("__FILE"):
                assert str(value).startswith("${") or key.endswith("_FILE"), (name, key)


def test_compose_runs_ray_with_token_auth_and_the_store_on_its_own_network():
    services = _compose()["services"]
    for name in ("ray-head", "ray-worker", "api"):
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"].startswith("${")
        assert "--dashboard-host=0.0.0.0" not in " ".join(services[name].get("command", []))
    on_store = {n for n, s in services.items() if "store" in s.get("networks", [])}
    assert on_store == {"postgres", "api"}
    assert _compose()["networks"]["store"]["internal"] is True
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"].startswith("/run/")


def test_compose_prometheus_holds_the_metrics_token_and_grafana_no_default_login():
    compose = _compose()
    services = compose["services"]
    (secret,) = services["prometheus"]["secrets"]
    assert compose["secrets"][secret["source"]]["environment"] == "ZEROSERVICE_METRICS_TOKEN"
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert services["grafana"]["secrets"] == ["grafana_admin_password"]


def test_pods_run_non_root_on_read_only_root_filesystems():
    specs = _pod_specs(_k8s())
    assert len(specs) == 3  # the API, the Ray head, the GPU workers
    for spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        mounts_tmp = any(v["name"] == "tmp" and "emptyDir" in v for v in spec["volumes"])
        assert mounts_tmp
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_the_api_keeps_its_home_across_a_restart_of_its_container():
    """The data directory the image names holds the scheduler lease's holder name (see
    [Note: a replica restarted after a crash] in api/lease.py): on the read-only root
    filesystem it could not be written, and in the container's own layer it would be
    lost at a restart."""
    home = re.search(r"ZEROSERVICE_HOME=(\S+)", (DEPLOY / "Dockerfile").read_text())
    assert home is not None
    (spec,) = [s for s in _pod_specs(_k8s()) if s["containers"][0]["name"] == "api"]
    (container,) = spec["containers"]
    mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert home.group(1) in mounted, f"{home.group(1)} is not on a volume: {mounted}"
    volume = next(v for v in spec["volumes"] if v["name"] == mounted[home.group(1)])
    assert "emptyDir" in volume  # kept while the pod lives, whatever its container does


def test_kuberay_secrets_come_from_the_secret_and_ray_auth_is_on():
    docs = _k8s()
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert {"admin-token", "metrics-token", "ray-auth-token", "database-url"} <= set(
        secret["stringData"]
    )
    for spec in _pod_specs(docs):
        for container in spec["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "zeroservice", "key": "ray-auth-token"}
            for name, entry in env.items():
                if re.search(r"TOKEN|PASSWORD|DATABASE_URL", name):
                    assert "value" not in entry, name
    ray = next(d for d in docs if d["kind"] == "RayCluster")
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert "metrics-token" in (DEPLOY / "kuberay" / "prometheus.yaml").read_text()
    assert "admin token" not in config["data"]["prometheus.yml"]


def test_network_policies_let_only_the_api_reach_the_store_and_rays_client_port():
    policies = {d["metadata"]["name"]: d for d in _k8s() if d["kind"] == "NetworkPolicy"}
    api = {"app.kubernetes.io/name": "zeroservice", "app.kubernetes.io/component": "api"}
    store = policies["zeroservice-store"]["spec"]
    assert store["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "postgresql"}
    (rule,) = store["ingress"]
    assert [p["podSelector"]["matchLabels"] for p in rule["from"]] == [api]
    assert rule["ports"] == [{"protocol": "TCP", "port": 5432}]
    ray = policies["zeroservice-ray"]["spec"]
    assert ray["podSelector"]["matchLabels"] == {"ray.io/cluster": "zeroservice"}
    for rule in ray["ingress"]:
        (peer,) = rule["from"]
        labels = peer["podSelector"]["matchLabels"]
        if labels == api:
            assert rule["ports"] == [{"protocol": "TCP", "port": 10001}]
        else:  # Ray's own pods, and Prometheus scraping the ranks
            assert labels in (
                {"ray.io/cluster": "zeroservice"},
                {"app.kubernetes.io/name": "prometheus"},
            )
