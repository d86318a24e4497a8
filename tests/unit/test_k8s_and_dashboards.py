"""Kubernetes manifests, the Grafana dashboard and the Prometheus configuration, checked
without a cluster: core objects against the Kubernetes schemas (kubernetes-validate), KEDA
objects and cross-references by hand, every metric a dashboard queries against the metrics
the code registers."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from shared.config import Settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
K8S_VERSION = "1.30.0"


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("doc", [d for d in manifests() if not d["apiVersion"].startswith("keda.sh")],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_core_objects_match_the_kubernetes_schemas(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_light_stages_run_the_slim_image_and_model_stages_the_model_image():
    deployments = by_kind("Deployment")
    for stage in ("gateway", "tokenizer", "postfilter"):
        (container,) = deployments[stage]["spec"]["template"]["spec"]["containers"]
        assert container["image"].startswith("pdserve-slim:"), stage
    for stage in ("prefill", "decode"):
        (container,) = deployments[stage]["spec"]["template"]["spec"]["containers"]
        assert container["image"].startswith("pdserve-model:"), stage
    for job in by_kind("Job").values():  # the model conversion needs torch
        for container in job["spec"]["template"]["spec"]["containers"]:
            assert container["image"].startswith("pdserve-model:")


def test_every_stage_has_a_deployment_with_probes_grace_and_a_pdb():
    deployments, pdbs = by_kind("Deployment"), by_kind("PodDisruptionBudget")
    config = by_kind("ConfigMap")["pdserve-config"]["data"]
    settings = Settings.from_env(config)  # every value converts
    unknown = [k for k in config if k[3:].lower() not in Settings.__dataclass_fields__]
    assert not unknown
    for stage in ("gateway", "tokenizer", "prefill", "decode", "postfilter"):
        pod = deployments[stage]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["command"] == ["python", "-m", f"services.{stage}"]
        assert importlib.util.find_spec(f"services.{stage}.__main__") is not None
        port = settings.gateway_port if stage == "gateway" else settings.metrics_port
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] == port
        assert container["readinessProbe"]["httpGet"]["path"] in ("/readyz", "/health/ready")
        # a worker drains for up to 20 s on SIGTERM (services/common/runtime.py): the grace covers it
        assert pod["terminationGracePeriodSeconds"] >= 30
        assert pdbs[stage]["spec"]["minAvailable"] >= 1
        assert pdbs[stage]["spec"]["selector"]["matchLabels"] == deployments[stage]["spec"]["selector"]["matchLabels"]
        assert {"configMapRef": {"name": "pdserve-config"}} in container["envFrom"]


def test_keda_scales_prefill_and_decode_on_their_jetstream_consumers():
    deployments = by_kind("Deployment")
    services = by_kind("Service")
    config = by_kind("ConfigMap")["pdserve-config"]["data"]
    proto = Settings.from_env(config).protocol()
    scaled = by_kind("ScaledObject")
    assert {"prefill", "decode"} <= set(scaled)
    for name, obj in scaled.items():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec = obj["spec"]
        assert spec["scaleTargetRef"]["name"] in deployments
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "nats-jetstream"
        meta = trigger["metadata"]
        queue = {q.stage: q for q in proto.work_queues}[name]
        assert (meta["stream"], meta["consumer"]) == (queue.stream, queue.durable)
        host, port = meta["natsServerMonitoringEndpoint"].split(":")
        assert host.split(".")[0] in services and int(port) in [p["port"] for p in services["nats"]["spec"]["ports"]]
        assert int(meta["lagThreshold"]) > 0


def registered_metrics() -> set[str]:
    from prometheus_client import REGISTRY

    from shared import metrics

    for stage in ("tokenizer", "prefill", "decode", "postfilter"):
        metrics.stage_metrics(stage)
    metrics.kv_metrics()
    metrics.gateway_metrics()
    metrics.queue_metrics()
    metrics.router_metrics()
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in REGISTRY.collect():
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


def test_dashboard_queries_only_metrics_that_exist():
    dash = json.loads((REPO / "infra" / "grafana" / "dashboards" / "pdserve.json").read_text())
    known = registered_metrics()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    used = {m for e in exprs for m in re.findall(r"\b(pd_[a-z0-9_]+)", e)}
    assert used and used <= known, used - known
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("ttft", "itl", "throughput", "backlog", "kv transfer", "prefix-cache"):
        assert topic in titles
    assert len({p["id"] if "id" in p else p["title"] for p in dash["panels"]}) == len(dash["panels"])


def test_prometheus_and_grafana_provisioning_fit_compose():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    prom = yaml.safe_load((REPO / "infra" / "prometheus" / "prometheus.yml").read_text())
    targets = {name for job in prom["scrape_configs"] for sd in job["dns_sd_configs"] for name in sd["names"]}
    assert targets == {"gateway", "tokenizer", "prefill", "decode", "postfilter"} and targets <= set(compose["services"])
    assert {sd["port"] for job in prom["scrape_configs"] for sd in job["dns_sd_configs"]} == {8000, 9100}
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provider = yaml.safe_load((REPO / "infra/grafana/provisioning/dashboards/pdserve.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert (REPO / mounts[path] / "pdserve.json").exists()
    ds = yaml.safe_load((REPO / "infra/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    dash = json.loads((REPO / "infra/grafana/dashboards/pdserve.json").read_text())
    assert all(p["datasource"]["uid"] == ds["uid"] for p in dash["panels"])
    assert "prometheus" in compose["services"] and ds["url"].startswith("http://prometheus:")


def test_nats_is_a_three_node_cluster_in_the_helm_chart_layout():
    """Issue 19: a StatefulSet of three with a headless service for the routes, each pod's DNS
    name a route and a client URL, JetStream on a volume per pod, replicas 3 in the settings."""
    (sts,) = [d for d in by_kind("StatefulSet").values() if d["metadata"]["name"] == "nats"]
    services = by_kind("Service")
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert 6222 in [p["port"] for p in headless["spec"]["ports"]]
    assert sts["spec"]["replicas"] == 3
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert {"name": "SERVER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    conf = by_kind("ConfigMap")["nats-config"]["data"]["nats.conf"]
    pods = [f"nats-{i}.{headless['metadata']['name']}.pdserve.svc.cluster.local" for i in range(3)]
    assert re.findall(r"nats://([\w.-]+):6222", conf) == pods
    assert "server_name: $SERVER_NAME" in conf and "jetstream" in conf
    config = by_kind("ConfigMap")["pdserve-config"]["data"]
    settings = Settings.from_env(config)
    assert settings.nats_replicas == 3
    assert re.findall(r"nats://([\w.-]+):4222", settings.nats_url) == pods
    assert by_kind("PodDisruptionBudget")["nats"]["spec"]["maxUnavailable"] == 1
