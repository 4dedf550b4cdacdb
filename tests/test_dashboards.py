"""Dashboards and deployment files agree with the code: every metric a panel queries is
exported, provisioning matches the dashboards, manifests parse and name the settings,
ports and secrets the code uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from api.metrics import FAMILIES as API_FAMILIES
from workers.metrics import FAMILIES as RANK_FAMILIES

ROOT = Path(__file__).parents[1]
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _exprs(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    out += [a["expr"] for a in dashboard["annotations"]["list"]]
    out += [v["definition"] for v in dashboard["templating"]["list"]]
    return out


def _family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in {**API_FAMILIES, **RANK_FAMILIES}:
            return name[: -len(suffix)]
    return name


def test_dashboards_are_generated_from_their_description():
    from dashboards.generate import main

    assert main(["--check"]) == 0
    assert {p.name for p in DASHBOARDS} == {"training-job.json", "control-plane.json"}


def test_every_metric_a_dashboard_uses_is_exported_and_the_reverse_is_listed(capsys):
    exported = set(API_FAMILIES) | set(RANK_FAMILIES)
    used: set[str] = set()
    for path in DASHBOARDS:
        for expr in _exprs(json.loads(path.read_text())):
            used |= {_family(n) for n in re.findall(r"zeroservice_[a-z_]+", expr)}
    assert used, "no metric found in the dashboards"
    assert sorted(used - exported) == []
    unused = sorted(exported - used)
    print(f"exported but on no dashboard: {unused}")
    # The training dashboard shows every rank family.
    assert not set(RANK_FAMILIES) - used


def test_grafana_provisioning_matches_the_dashboards():
    datasources = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    (source,) = datasources["datasources"]
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
        assert uids == {source["uid"]}
        assert dashboard["uid"].startswith("zeroservice-")
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/zeroservice.yml").read_text()
    )["providers"][0]
    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"../dashboards:{provider['options']['path']}:ro" in mounts


def _settings_env() -> set[str]:
    text = (ROOT / "api/settings.py").read_text() + (ROOT / "api/serve.py").read_text()
    return set(re.findall(r"ZEROSERVICE_[A-Z_]+", text))


def _k8s_docs() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "deploy/kuberay").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_manifests_parse_and_agree_with_the_code():
    from api.settings import Settings

    known_env = _settings_env()
    docs = _k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "Deployment", "Service", "Secret", "ConfigMap"} <= kinds
    secret = next(d for d in docs if d["kind"] == "Secret")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (api,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in api["env"]}
    for name, entry in env.items():
        if name.startswith("ZEROSERVICE_"):
            assert name in known_env, f"{name} is not a setting the code reads"
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] == secret["metadata"]["name"]
            assert ref["key"] in secret["stringData"]
    port = int(env["ZEROSERVICE_PORT"]["value"])
    assert port == Settings().port
    assert api["ports"][0]["containerPort"] == port
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["ports"][0]["port"] == port
    assert api["command"] == ["python", "-m", "api.serve"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ray = next(d for d in docs if d["kind"] == "RayCluster")
    (gpu,) = ray["spec"]["workerGroupSpecs"]
    assert gpu["minReplicas"] < gpu["maxReplicas"] and ray["spec"]["enableInTreeAutoscaling"]
    worker = gpu["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "RayCluster")
        for c in _containers(d)
    }
    assert len(images) == 1
    config = yaml.safe_load(
        next(d for d in docs if d["kind"] == "ConfigMap")["data"]["prometheus.yml"]
    )
    _check_scrape(config, f"zeroservice-api:{port}")


def _containers(doc: dict) -> list[dict]:
    if doc["kind"] == "Deployment":
        return doc["spec"]["template"]["spec"]["containers"]
    head = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return head + [
        c for g in doc["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]
    ]


def _check_scrape(config: dict, api_address: str) -> None:
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["zeroservice-api"]["static_configs"][0]["targets"] == [api_address]
    (sd,) = jobs["zeroservice-ranks"]["http_sd_configs"]
    assert sd["url"] == f"http://{api_address}/v1/targets"
    assert sd["authorization"]["credentials_file"]


def test_compose_agrees_with_the_code():
    from api.settings import Settings

    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    services = compose["services"]
    assert {"api", "ray-head", "ray-worker", "prometheus", "grafana", "postgres"} <= set(services)
    api = services["api"]
    known = _settings_env()
    assert {k for k in api["environment"] if k.startswith("ZEROSERVICE_")} <= known
    port = int(api["environment"]["ZEROSERVICE_PORT"])
    assert port == Settings().port and api["ports"] == [f"127.0.0.1:{port}:{port}"]
    # The API joins through Ray Client (it is not a Ray node itself).
    assert api["environment"]["ZEROSERVICE_RAY_ADDRESS"] == "ray://ray-head:10001"
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    _check_scrape(config, f"api:{port}")
    target = services["prometheus"]["secrets"][0]["target"]
    sd = next(j for j in config["scrape_configs"] if j["job_name"] == "zeroservice-ranks")
    assert sd["http_sd_configs"][0]["authorization"]["credentials_file"] == target
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    assert f"ZEROSERVICE_PORT={port}" in dockerfile and f"EXPOSE {port}" in dockerfile
    assert '"api.serve"' in dockerfile
