"""The generated references in docs/reference/ match their sources (this is how CI checks them)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from ridethrough import catalogue, reference
from ridethrough.config import env_var
from ridethrough.settings import COMPONENTS, ActuatorConfig, AgentConfig
from tests.conftest import ROOT


def test_checked_in_references_are_current() -> None:
    stale = reference.stale(ROOT)
    assert not stale, (f"{', '.join(stale)} differ from what their sources generate; run "
                       f"`{reference.REGENERATE}` and commit the result")


def test_config_reference_names_every_field_and_its_variable() -> None:
    text = reference.config_reference()
    for component, model in COMPONENTS.items():
        assert f"## `{component}`" in text
        for f in dataclasses.fields(model):
            assert f"| `{f.name}` |" in text, f"{component}.{f.name} missing"
            assert f"`{env_var(component, f.name)}`" in text


def test_config_reference_shows_defaults_and_limits() -> None:
    text = reference.config_reference()
    row = next(line for line in text.splitlines() if line.startswith("| `spool_max_bytes` |"))
    assert "`1073741824` (1 GiB)" in row and "≥ 0" in row and "RIDETHROUGH_GATEWAY_SPOOL_MAX_BYTES" in row
    row = next(line for line in text.splitlines() if line.startswith("| `reflex_watch` |"))
    assert "one of `active`, `all`" in row
    row = next(line for line in text.splitlines() if line.startswith("| `probe_port` |"))
    assert "1 to 65535" in row and "`7447`" in row


def test_metrics_reference_lists_every_catalogued_metric_and_service_metric() -> None:
    text = reference.metrics_reference()
    for m in catalogue.metrics():
        assert f"`{m.name}`<br>" in text
    for name in ("ridethrough_gateway_spool_bytes", "ridethrough_controller_detector_runs_total",
                 "ridethrough_actuator_decisions_total", "ridethrough_pagerduty_outbox_pending",
                 "ridethrough_control_refusals_total"):
        assert f"`{name}`" in text


@pytest.mark.parametrize("render", [reference.config_reference, reference.metrics_reference])
def test_tables_keep_their_columns(render: object) -> None:
    """Every row of every table has the header's column count: a stray '|' in a help text would break it."""
    assert callable(render)
    header_cols = 0
    for line in render().splitlines():
        if not line.startswith("|"):
            header_cols = 0
            continue
        cols = len(re.findall(r"(?<!\\)\|", line)) - 1
        if header_cols == 0:
            header_cols = cols
        assert cols == header_cols, line


def _copy_docs(tmp_path: Path) -> Path:
    for rel in reference.TARGETS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_check_names_the_stale_file_and_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy_docs(tmp_path)
    assert reference.main(["--check", "--root", str(root)]) == 0
    target = root / reference.CONFIG_MD
    target.write_text(target.read_text().replace("RIDETHROUGH_AGENT_GATEWAY", "RIDETHROUGH_AGENT_GATEWAI"))
    assert reference.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert reference.CONFIG_MD in err and reference.REGENERATE in err and reference.METRICS_MD not in err


def test_write_creates_missing_files_then_changes_nothing(tmp_path: Path) -> None:
    assert reference.stale(tmp_path) == list(reference.TARGETS)
    assert reference.write(tmp_path) == list(reference.TARGETS)
    assert reference.write(tmp_path) == []
    assert reference.main(["--check", "--root", str(tmp_path)]) == 0


def _knob_rows(doc: str) -> dict[str, str]:
    """The first two cells of every table row whose first cell is one `name`: knob → default cell."""
    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / doc).read_text().splitlines():
        match = re.match(r"\| `([a-z_]+)` \| ([^|]+) \|", line)
        if match:
            rows.setdefault(match[1], match[2].strip())
    return rows


@pytest.mark.parametrize(("model", "prefix"), [(ActuatorConfig, ""), (AgentConfig, "reflex")])
def test_actuator_safety_lists_every_policy_knob_with_its_default(model: type, prefix: str) -> None:
    """docs/actuator-safety.md is written by hand: hold its knob tables to the config models."""
    rows = _knob_rows("actuator-safety.md")
    for f in dataclasses.fields(model):
        if not f.name.startswith(prefix):
            continue
        assert f.name in rows, f"docs/actuator-safety.md does not list {model.__name__}.{f.name}"
        assert rows[f.name] == f"`{json.dumps(f.default)}`", (
            f"docs/actuator-safety.md gives {f.name} the default {rows[f.name]}, the model {f.default!r}")
