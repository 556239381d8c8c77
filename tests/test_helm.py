"""The Helm chart, rendered and linted offline (helm-python-sdk bundles Helm) for several values sets.

Each set is also checked against Kubernetes' own schemas (kubernetes-validate, strict: unknown
fields fail), each rendered config file is loaded by ridethrough's config loader, and the
invariants the deployment relies on are asserted on the YAML: capabilities, probes, where
secrets travel, one acting controller.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from ridethrough.dashboards.config import load_dashboard_config
from ridethrough.settings import load_component

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ridethrough"
KUBE_VERSION = "1.30.0"
CRD_KINDS = {"ClickHouseInstallation", "ClickHouseKeeperInstallation", "ServiceMonitor", "PodMonitor"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
SECRETS = {"dsn": "http://ingest:Dsn-Pass-123@ch.example:8123/otel", "password": "Ch-Pass-456"}

VALUES: dict[str, dict[str, Any]] = {
    "default": {},
    "external": {"store": {"external": {"dsn": SECRETS["dsn"]}, "cluster": "prod"},
                 "gateway": {"spool": {"type": "pvc", "size": "50Gi"}, "ingestTokens": {"existingSecret": "ingest"}},
                 "metrics": {"serviceMonitor": {"enabled": True}}, "pagerduty": {"existingSecret": "pd-keys"},
                 "config": {"pagerduty": {"enabled": True,
                                          "routing_keys": {"*": "file:/etc/ridethrough/pagerduty/a"}}}},
    "in-cluster-clickhouse": {"store": {"mode": "clickhouse", "cluster": "fleet",
                                        "clickhouse": {"shards": 4, "replicas": 2, "password": SECRETS["password"]}},
                              "controller": {"replicas": 2},
                              "dashboard": {"ingress": {"enabled": True}, "existingSecret": "dash-auth"},
                              "config": {"dashboard": {"basic_auth_user": "sre", "workers": 4,
                                                       "basic_auth_password": "file:/etc/ridethrough/dashboard/pw"}}},
    "dry-run-actuators": {"config": {"actuators": {"enabled": True, "dry_run": True, "max_concurrent": 4},
                                     "agent": {"reflex": True, "interval_s": 2.0}},
                          "controller": {"leaderElection": {"enabled": False}},
                          "controlPlane": {"existingSecret": "control-keys"}},
    "no-controller": {"controller": {"enabled": False}, "agent": {"netAdmin": False},
                      "gateway": {"autoscaling": {"enabled": False}, "replicas": 3}},
}


def _load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("generate_schema", ROOT / "helm" / "generate_schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate_schema"] = module
    spec.loader.exec_module(module)
    return module


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders for ``values``, hooks included."""
    out = helm.Chart.load(CHART).render(values, name="rt", namespace="gpu")
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    return [d for d in docs if isinstance(d, dict) and "kind" in d]


@pytest.fixture(scope="module", params=sorted(VALUES))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(VALUES[request.param])


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in WORKLOADS or doc["kind"] == "Job":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def test_values_schema_is_generated_from_the_config_models() -> None:
    generator = _load_generator()
    assert (CHART / "values.schema.json").read_text() == generator.render(), \
        "stale: run .venv/bin/python helm/generate_schema.py"
    agent = generator.build_schema()["properties"]["config"]["properties"]["agent"]
    assert agent["properties"]["probe_port"]["maximum"] == 65535 and agent["additionalProperties"] is False


def test_chart_lints_clean(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, _ = rendered
    report = helm.lint(CHART, VALUES[name], strict=True, namespace="gpu")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_objects_are_valid_kubernetes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_every_container_has_probes_resources_and_no_privilege(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for doc, c in containers(docs):
        if doc["kind"] != "Job":
            assert c["livenessProbe"] and c["readinessProbe"], doc["metadata"]["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"], doc["metadata"]["name"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"] and "privileged" not in sc
        assert set(sc["capabilities"].get("add", [])) <= {"NET_ADMIN"}


def test_rendered_config_files_load_with_the_models(rendered: tuple[str, list[dict[str, Any]]],
                                                    tmp_path: Path) -> None:
    name, docs = rendered
    files = by_kind(docs, "ConfigMap")["rt-ridethrough-config"]["data"]
    for file, sections in (("agent.yaml", ["agent"]), ("gateway.yaml", ["gateway"]),
                           ("controller.yaml", ["gateway", "controller", "actuators", "pagerduty"])):
        path = tmp_path / file
        path.write_text(files[file])
        for section in sections:
            load_component(section, file=path, env={})  # raises ConfigError on any bad key or value
    actuators = load_component("actuators", file=tmp_path / "controller.yaml", env={}).config
    assert actuators.enabled is (name == "dry-run-actuators") and actuators.dry_run is True
    (tmp_path / "dashboard.yaml").write_text(files["dashboard.yaml"])
    dashboard = load_dashboard_config(file=tmp_path / "dashboard.yaml", env={}).config
    assert dashboard.listen == "0.0.0.0:8050" and dashboard.store == ""  # the gateway's store, from its Secret


def test_no_secret_reaches_a_configmap_or_a_plain_env_value(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for cm in by_kind(docs, "ConfigMap").values():
        text = yaml.safe_dump(cm)
        assert not any(s in text for s in SECRETS.values())
        assert not re.search(r"://[^/\s:@]+:[^@\s]+@", text), "a DSN with a password in a ConfigMap"
    for doc in docs:
        if doc["kind"] not in ("Secret", "ConfigMap"):
            assert not any(s in yaml.safe_dump(doc) for s in SECRETS.values()), doc["metadata"]["name"]
    for _, c in containers(docs):
        for env in c.get("env", []):
            if env["name"] == "RIDETHROUGH_GATEWAY_STORE":
                assert "valueFrom" in env or "$(CLICKHOUSE_PASSWORD)" in env["value"]


def test_agent_daemonset_runs_on_gpu_nodes_with_what_it_needs() -> None:
    docs = render({})
    pod = by_kind(docs, "DaemonSet")["rt-ridethrough-agent"]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["runtimeClassName"] == "nvidia" and pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    agent = pod["containers"][0]
    assert agent["securityContext"]["capabilities"]["add"] == ["NET_ADMIN"]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in agent["env"]
    sys_mount = next(m for m in agent["volumeMounts"] if m["name"] == "sys")
    assert sys_mount == {"name": "sys", "mountPath": "/host/sys", "readOnly": True}
    assert {"name": "sys", "hostPath": {"path": "/sys", "type": "Directory"}} in pod["volumes"]
    without = by_kind(render(VALUES["no-controller"]), "DaemonSet")["rt-ridethrough-agent"]
    sc = without["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert "add" not in sc["capabilities"] and sc["runAsNonRoot"] is True


def test_a_control_plane_secret_turns_on_the_agents_control_plane_and_the_controllers_signing() -> None:
    docs = render(VALUES["dry-run-actuators"])
    agent = by_kind(docs, "DaemonSet")["rt-ridethrough-agent"]["spec"]["template"]["spec"]["containers"][0]
    controller = by_kind(docs, "Deployment")["rt-ridethrough-controller"]["spec"]["template"]["spec"]["containers"][0]
    mount = {"name": "control", "mountPath": "/etc/ridethrough/control", "readOnly": True}
    for container, var in ((agent, "RIDETHROUGH_AGENT_CONTROL_KEYS_FILE"),
                           (controller, "RIDETHROUGH_CONTROL_KEYS_FILE")):
        assert {"name": var, "value": "/etc/ridethrough/control/keys"} in container["env"]
        assert mount in container["volumeMounts"]
    plain = by_kind(render({}), "DaemonSet")["rt-ridethrough-agent"]["spec"]["template"]["spec"]["containers"][0]
    assert not any(e["name"] == "RIDETHROUGH_AGENT_CONTROL_KEYS_FILE" for e in plain["env"])


def test_gateway_scales_and_keeps_its_spool() -> None:
    docs = render(VALUES["external"])
    gateway = by_kind(docs, "StatefulSet")["rt-ridethrough-gateway"]  # a PVC spool: stable per-replica claims
    assert gateway["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "50Gi"
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["rt-ridethrough-gateway"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": "rt-ridethrough-gateway"}
    pdb = by_kind(docs, "PodDisruptionBudget")["rt-ridethrough-gateway"]
    assert pdb["spec"]["selector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]
    ports = by_kind(docs, "Service")["rt-ridethrough-gateway"]["spec"]["ports"]
    assert {"name": "otlp-grpc", "port": 4317, "targetPort": "otlp-grpc", "protocol": "TCP",
            "appProtocol": "grpc"} in ports
    gateway_yaml = by_kind(docs, "ConfigMap")["rt-ridethrough-config"]["data"]["gateway.yaml"]
    assert "gateway:\n  cluster: prod\n" in gateway_yaml
    assert "tokens_file: /etc/ridethrough/ingest/tokens" in gateway_yaml
    pod = gateway["spec"]["template"]["spec"]
    assert {"name": "ingest-tokens", "secret": {"secretName": "ingest", "defaultMode": 0o400}} in pod["volumes"]
    assert {"ServiceMonitor", "PodMonitor"} <= {d["kind"] for d in docs}
    plain = render(VALUES["no-controller"])
    assert by_kind(plain, "Deployment")["rt-ridethrough-gateway"]["spec"]["replicas"] == 3
    assert "HorizontalPodAutoscaler" not in {d["kind"] for d in plain}


def test_one_controller_acts_leader_elected_or_alone() -> None:
    docs = render(VALUES["in-cluster-clickhouse"])
    ctl = by_kind(docs, "Deployment")["rt-ridethrough-controller"]["spec"]
    assert ctl["replicas"] == 2 and ctl["template"]["spec"]["automountServiceAccountToken"] is True
    command = ctl["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "ridethrough-leader" and "--lease=rt-ridethrough-controller" in command
    rules = by_kind(docs, "Role")["rt-ridethrough-controller-lease"]["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
            "resourceNames": ["rt-ridethrough-controller"], "verbs": ["get", "update"]} in rules
    alone = by_kind(render(VALUES["dry-run-actuators"]), "Deployment")["rt-ridethrough-controller"]["spec"]
    assert alone["strategy"] == {"type": "Recreate"} and "command" not in alone["template"]["spec"]["containers"][0]
    with pytest.raises(helm.HelmRenderError, match=r"replicas above 1 needs controller\.leaderElection\.enabled"):
        render({"controller": {"replicas": 2, "leaderElection": {"enabled": False}}})
    none = render(VALUES["no-controller"])
    assert "rt-ridethrough-controller" not in by_kind(none, "Deployment") and not by_kind(none, "Role")


def test_in_cluster_clickhouse_is_sharded_replicated_and_coordinated_by_keeper() -> None:
    docs = render(VALUES["in-cluster-clickhouse"])
    chi = by_kind(docs, "ClickHouseInstallation")["rt-ridethrough"]["spec"]
    assert chi["configuration"]["clusters"] == [{"name": "fleet", "layout": {"shardsCount": 4, "replicasCount": 2}}]
    assert chi["configuration"]["zookeeper"]["nodes"] == [{"host": "keeper-rt-ridethrough", "port": 2181}]
    assert chi["configuration"]["users"]["ridethrough/k8s_secret_password"] == "gpu/rt-ridethrough-clickhouse/password"
    keeper = by_kind(docs, "ClickHouseKeeperInstallation")["rt-ridethrough"]["spec"]
    assert keeper["configuration"]["clusters"][0]["layout"]["replicasCount"] == 3
    assert by_kind(docs, "Secret")["rt-ridethrough-clickhouse"]["stringData"] == {"password": SECRETS["password"]}
    assert "gateway:\n  cluster: fleet\n" in by_kind(docs, "ConfigMap")["rt-ridethrough-config"]["data"]["gateway.yaml"]


@pytest.mark.parametrize(("values", "error"), [
    ({"config": {"gateway": {"store": SECRETS["dsn"]}}}, "config.gateway.store is set by the chart"),
    ({"config": {"agent": {"gateway": "x:4317"}}}, "config.agent.gateway is set by the chart"),
    ({"config": {"dashboard": {"store": SECRETS["dsn"]}}}, "config.dashboard.store is set by the chart"),
    ({"config": {"pagerduty": {"routing_keys": {"*": "0123456789abcdef0123456789abcdef"}}}},
     "routing_keys.* must be env:VAR or file:PATH"),
    ({"store": {"mode": "clickhouse", "cluster": "fleet"}}, "needs the ClickHouse user's password"),
    ({"store": {"mode": "clickhouse", "cluster": "fleet", "clickhouse": {"password": "p@ss:word"}}},
     "may hold only letters, digits"),
    ({"store": {"mode": "clickhouse", "clickhouse": {"password": "pw"}}}, "store.cluster names the ClickHouse cluster"),
])
def test_bad_values_stop_the_render_with_the_value_to_change(values: dict[str, Any], error: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(error)):
        render(values)


@pytest.mark.parametrize(("values", "where"), [
    ({"config": {"agent": {"interval": 2}}}, "additional properties 'interval' not allowed"),
    ({"config": {"agent": {"probe_port": 70000}}}, "/config/agent/probe_port"),
    ({"config": {"surprise": {}}}, "additional properties 'surprise' not allowed"),
    ({"store": {"mode": "sqlite"}}, "/store/mode"),
])
def test_values_outside_the_schema_are_refused_by_helm(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(values)
