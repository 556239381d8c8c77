"""The Prometheus alert rules in rules/: promtool checks and unit-tests them, and they use only real metric names."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from detectors.controller import ControllerMetrics
from exporters.gateway_metrics import GatewayMetrics
from ridethrough import catalogue
from ridethrough.collector.prometheus import prometheus_name

PROMTOOL = Path("/usr/bin/promtool")
ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "rules" / "ridethrough.rules.yml"
TESTS = sorted((ROOT / "rules" / "tests").glob("*.yml"))
ALERTS = {"GpuFatalXid", "GpuFailurePredicted", "LinkDown", "LinkDegrading", "ClockUnsynchronised", "AgentSilent",
          "PipelineBacklog", "ControllerDown"}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not PROMTOOL.exists():
        why = f"{PROMTOOL} is missing (Debian package prometheus; `make test` installs it)"
        if os.geteuid() == 0 or os.environ.get("CI"):
            pytest.fail(why)  # CI runs `make test` as root, which installs it: missing there is a bug
        pytest.skip(f"{why}; not root, so it cannot be installed here: sudo apt-get install prometheus")
    return subprocess.run([str(PROMTOOL), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict[str, object]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules() -> None:
    done = _promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass() -> None:
    assert TESTS
    done = _promtool("test", "rules", *map(str, TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_severity_annotations_runbook_and_tests_that_fire_and_do_not() -> None:
    alerts = {r["alert"]: r for r in _rules() if "alert" in r}
    assert set(alerts) == ALERTS
    cases: dict[str, list[list[object]]] = {}
    for path in TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], []).append(case["exp_alerts"])
    for name, rule in alerts.items():
        labels, annotations = rule["labels"], rule["annotations"]
        assert isinstance(labels, dict) and labels["severity"] in {"critical", "warning"}, name
        assert isinstance(annotations, dict) and {"summary", "description", "runbook_url"} <= annotations.keys()
        assert annotations["runbook_url"] == f"docs/runbooks/{name}.md"
        assert (ROOT / annotations["runbook_url"]).is_file(), name
        runs = cases.get(name, [])
        assert any(runs) and any(not c for c in runs), f"{name}: needs a case that fires and one that does not"


_FUNCTIONS = {"sum", "max", "min", "by", "on", "or", "and", "unless", "offset", "increase", "rate", "deriv",
              "label_replace", "last_over_time", "absent", "group_left", "without"}


def _exposed_names() -> set[str]:
    names = {prometheus_name(m.name, m.unit, m.kind) for m in catalogue.metrics()}
    names |= {"up", "target_info"}
    gateway, controller = GatewayMetrics.create(), ControllerMetrics.create()
    controller.runs.labels("x")
    controller.errors.labels("x")
    for registry in (gateway.registry, controller.registry):
        names |= {s.name for fam in registry.collect() for s in fam.samples}
    assert "ridethrough_gateway_backpressure_total" in generate_latest(gateway.registry).decode()
    return names


def test_every_metric_in_the_rules_is_one_ridethrough_exposes() -> None:
    exposed = _exposed_names()
    recorded = {r["record"] for r in _rules() if "record" in r}
    used: set[str] = set()
    for rule in _rules():
        expr = re.sub(r'"[^"]*"', '""', str(rule["expr"]))  # no label values
        expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # no matchers or ranges
        expr = re.sub(r"\b(by|on|without|group_left|group_right)\s*\([^)]*\)", "", expr)  # no label lists
        expr = re.sub(r"\b\d[\d.]*(ms|[smhdwy])?\b", "", expr)  # no numbers or durations (offset 5m)
        used |= {t for t in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if t not in _FUNCTIONS}
    assert used, "no metric names found"
    assert used <= exposed | recorded, f"not exposed by ridethrough: {sorted(used - exposed - recorded)}"
    assert "ridethrough_gpu_xid_total" in used and "ridethrough_controller_detector_runs_total" in used
