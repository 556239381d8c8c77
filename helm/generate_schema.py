"""Write helm/ridethrough/values.schema.json: the chart's values, checked by Helm on every render.

The ``config`` part is generated from the components' typed config models
(`ridethrough.settings.COMPONENTS`, through `ridethrough.config.json_schema`), the same models
that load a ``--config`` file, so a misspelt or mistyped setting fails at ``helm install``,
not in a pod. The deployment part (images, replicas, storage) is declared here.

Run ``.venv/bin/python helm/generate_schema.py`` after changing a config model;
``--check`` exits 1 if the committed file differs (tests/test_helm.py does the same).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ridethrough.config import json_schema
from ridethrough.dashboards.config import DashboardConfig
from ridethrough.settings import COMPONENTS

SCHEMA_PATH = Path(__file__).resolve().parent / "ridethrough" / "values.schema.json"
CHART_COMPONENTS = ("agent", "gateway", "controller", "actuators", "pagerduty", "dashboard")
"""The config sections the chart renders into its components' config files."""
MODELS: dict[str, type] = {**COMPONENTS, "dashboard": COMPONENTS.get("dashboard", DashboardConfig)}
"""Each section's model: `COMPONENTS`, and the dashboard's own (loaded beside them by `ridethrough dashboard`)."""
NOT_DEPLOYED = {"server": "the all-in-one process; the chart runs gateway, controller and dashboard apart"}
"""Components the chart does not run, and why (every component is one or the other)."""

Schema = dict[str, Any]


def _obj(properties: dict[str, Schema], description: str = "") -> Schema:
    out: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if description:
        out["description"] = description
    return out


def _str(description: str = "", **extra: Any) -> Schema:
    return {"type": "string", **({"description": description} if description else {}), **extra}


def _int(minimum: int = 0, maximum: int | None = None) -> Schema:
    return {"type": "integer", "minimum": minimum, **({} if maximum is None else {"maximum": maximum})}


_BOOL: Schema = {"type": "boolean"}
_PORT = _int(1, 65535)
_K8S: Schema = {"type": "object", "description": "Passed to Kubernetes as it is."}
_LABELS: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
_TOLERATIONS: Schema = {"type": "array", "items": {"type": "object"}}
_QUANTITY: Schema = {"type": ["string", "integer"], "description": "A Kubernetes quantity, e.g. 20Gi."}
_VOLUME = _obj({"type": _str("emptyDir or pvc", enum=["emptyDir", "pvc"]), "size": _QUANTITY,
                "storageClassName": _str()})


def _placement() -> dict[str, Schema]:
    return {"nodeSelector": _LABELS, "tolerations": _TOLERATIONS, "affinity": _K8S, "podAnnotations": _LABELS,
            "resources": _K8S}


def config_schema() -> Schema:
    """The ``config`` value: one section per component the chart runs, each its model's JSON Schema."""
    sections: dict[str, Schema] = {}
    for name in CHART_COMPONENTS:
        schema = json_schema(MODELS[name])
        schema.pop("$schema")  # only the document's root declares the dialect
        sections[name] = schema
    return _obj(sections, "Each component's settings, as in a `ridethrough --config` file.")


def deployment_schema() -> dict[str, Schema]:
    """The chart's own values: what runs where, with which image and resources."""
    return {
        "image": _obj({"server": _str(), "agent": _str(), "tag": _str(),
                       "pullPolicy": _str(enum=["Always", "IfNotPresent", "Never"])}),
        "imagePullSecrets": {"type": "array", "items": {"type": "object"}},
        "agent": _obj({"enabled": _BOOL, "runtimeClassName": _str(), "netAdmin": _BOOL, "metricsPort": _PORT,
                       "jobSocketDir": _str(pattern="^/"), "priorityClassName": _str(), "updateStrategy": _K8S,
                       **_placement()}),
        "gateway": _obj({
            "replicas": _int(1), "otlpPort": _PORT, "metricsPort": _PORT,
            "autoscaling": _obj({"enabled": _BOOL, "minReplicas": _int(1), "maxReplicas": _int(1),
                                 "targetCPUUtilizationPercentage": _int(1, 100)}),
            "podDisruptionBudget": _obj({"enabled": _BOOL, "maxUnavailable": {"type": ["integer", "string"]}}),
            "spool": _VOLUME, "service": _obj({"type": _str(enum=["ClusterIP", "NodePort", "LoadBalancer"])}),
            "ingestTokens": _obj({"existingSecret": _str("Secret with the OTLP bearer tokens file."),
                                  "key": _str(minLength=1)}),
            **_placement()}),
        "controller": _obj({
            "enabled": _BOOL, "replicas": _int(1), "metricsPort": _PORT, "state": _VOLUME,
            "leaderElection": _obj({"enabled": _BOOL, "leaseDurationS": _int(2), "renewDeadlineS": _int(1),
                                    "retryPeriodS": _int(1), "healthPort": _PORT}),
            **_placement()}),
        "dashboard": _obj({
            "enabled": _BOOL, "replicas": _int(1), "port": _PORT,
            "existingSecret": _str("Secret with the basic-auth password file."),
            "service": _obj({"type": _str(enum=["ClusterIP", "NodePort", "LoadBalancer"]), "port": _PORT}),
            "ingress": _obj({"enabled": _BOOL, "className": _str(), "host": _str(), "tlsSecret": _str(),
                             "annotations": _LABELS}),
            **_placement()}),
        "store": _obj({
            "mode": _str("external: your ClickHouse; clickhouse: the Altinity operator builds one",
                         enum=["external", "clickhouse"]),
            "cluster": _str("ClickHouse cluster name; non-empty: Replicated + Distributed tables, ON CLUSTER",
                            pattern="^[A-Za-z0-9_]*$"),
            "external": _obj({"existingSecret": _str(), "existingSecretKey": _str(minLength=1),
                              "dsn": {**_str("Put into a Secret by the chart."), "writeOnly": True}}),
            "clickhouse": _obj({
                "shards": _int(1), "replicas": _int(1), "keeperReplicas": {"enum": [1, 3, 5]},
                "image": _str(), "keeperImage": _str(), "user": _str(pattern="^[A-Za-z0-9_]+$"),
                "database": _str(pattern="^[A-Za-z0-9_]+$"), "existingSecret": _str(),
                "password": {**_str("Put into a Secret by the chart."), "writeOnly": True},
                "storage": _QUANTITY, "keeperStorage": _QUANTITY, "storageClassName": _str(), "resources": _K8S}),
            "initJob": _BOOL}),
        "pagerduty": _obj({"existingSecret": _str("Secret whose keys are integration keys, mounted as files.")}),
        "controlPlane": _obj({"existingSecret": _str("Secret with the control plane's keys and certificates."),
                              "keysKey": _str("The Secret's key holding the command keys file.", minLength=1)}),
        "serviceAccount": _obj({"create": _BOOL, "name": _str()}),
        "metrics": _obj({"serviceMonitor": _obj({"enabled": _BOOL, "interval": _str(), "labels": _LABELS})}),
        "podSecurityContext": _K8S,
    }


def build_schema() -> Schema:
    """The whole values.schema.json document."""
    uncovered = set(MODELS) - set(CHART_COMPONENTS) - set(NOT_DEPLOYED)
    if uncovered:
        raise ValueError(f"component(s) {sorted(uncovered)} are neither in the chart's config nor in NOT_DEPLOYED")
    doc: Schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "ridethrough Helm values"}
    doc.update(_obj({"config": config_schema(), **deployment_schema()}))
    return doc


def render() -> str:
    """The file's text: stable key order, two-space indent, a final newline."""
    return json.dumps(build_schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the schema, or with ``--check`` say whether the committed one is current."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not what would be written")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
        if current != text:
            print(f"{SCHEMA_PATH} is stale: run .venv/bin/python helm/generate_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
