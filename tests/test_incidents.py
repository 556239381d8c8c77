"""The incident lifecycle in a real chDB store: open, update, escalate, resolve, flapping, reopen, restart.

One chDB store per test module (a process hosts one store path at a time); each test uses its
own entities so that incidents of one test do not meet another's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ridethrough.detectors.contract import EntityType, Finding, FindingKind, Severity
from ridethrough.detectors.incidents import (
    INCIDENTS,
    IncidentTracker,
    State,
    TransitionKind,
    ensure_incidents_table,
    incidents_ddl,
)
from ridethrough.exporters.store import Store

S = 1_000_000_000
T0 = 1_700_000_000 * S


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(f"chdb://{tmp_path_factory.mktemp('incidents') / 'store'}")
    ensure_incidents_table(s)
    yield s
    s.close()


def finding(entity: str, *, severity: Severity = Severity.WARNING, kind: FindingKind = FindingKind.LINK_DOWN,
            detector: str = "link") -> Finding:
    # each test's entities are its own cluster, so trackers of other tests never touch them
    return Finding(detector=detector, kind=kind, entity_type=EntityType.LINK, entity=entity, severity=severity,
                   confidence=0.9, summary=f"{entity} is down", observed_at_ns=T0, evidence={"loss": 1.0},
                   cluster=entity.rstrip("0123456789"))


def tracker(store: Store, cluster: str, now_ns: int = T0) -> IncidentTracker:
    t = IncidentTracker(store, quiet_s=30, reopen_hysteresis_s=120, clock=lambda: now_ns, cluster=cluster)
    t.load()
    return t


def kinds(transitions: list) -> list[TransitionKind]:  # type: ignore[type-arg]  # any Transition list
    return [t.kind for t in transitions]


def current(store: Store, entity: str) -> list[tuple[object, ...]]:
    _, rows = store.query(
        "SELECT IncidentId, State, Severity, Findings, Version, Reopens FROM incidents FINAL "
        "WHERE Entity = {e:String} ORDER BY OpenedAt", parameters={"e": entity})
    return rows


def test_open_update_resolve(store: Store) -> None:
    t = tracker(store, "a-b")
    [opened] = t.observe([finding("a-b")], T0)
    assert opened.kind is TransitionKind.OPENED and opened.incident.state is State.OPEN
    assert len(opened.incident.trace_id) == 32 and int(opened.incident.trace_id, 16) >= 0
    assert kinds(t.observe([finding("a-b")], T0 + 10 * S)) == [TransitionKind.UPDATED]
    assert t.observe([], T0 + 39 * S) == []  # quiet for 29 s: not yet
    [resolved] = t.observe([], T0 + 40 * S)
    assert resolved.kind is TransitionKind.RESOLVED
    assert resolved.incident.incident_id == opened.incident.incident_id
    assert resolved.incident.resolved_at_ns == T0 + 40 * S
    assert current(store, "a-b") == [(opened.incident.incident_id, "resolved", 2, 2, 3, 0)]


def test_flapping_evidence_keeps_one_incident(store: Store) -> None:
    t = tracker(store, "flap")
    ids = set()
    for step in range(12):  # present, absent 10 s, present ... (absences shorter than quiet_s)
        now = T0 + step * 10 * S
        for tr in t.observe([finding("flap")] if step % 2 == 0 else [], now):
            ids.add(tr.incident.incident_id)
            assert tr.kind in (TransitionKind.OPENED, TransitionKind.UPDATED)
    assert len(ids) == 1
    rows = current(store, "flap")
    assert len(rows) == 1 and rows[0][1] == "open" and rows[0][3] == 6


def test_resolve_then_refind_within_hysteresis_reopens_the_same_incident(store: Store) -> None:
    t = tracker(store, "re")
    [opened] = t.observe([finding("re")], T0)
    [resolved] = t.observe([], T0 + 30 * S)
    assert resolved.kind is TransitionKind.RESOLVED
    [reopened] = t.observe([finding("re")], T0 + 100 * S)  # 70 s after resolving < 120 s
    assert reopened.kind is TransitionKind.REOPENED
    assert reopened.incident.incident_id == opened.incident.incident_id
    assert reopened.incident.trace_id == opened.incident.trace_id
    assert reopened.incident.state is State.OPEN and reopened.incident.resolved_at_ns == 0
    assert current(store, "re") == [(opened.incident.incident_id, "open", 2, 2, 3, 1)]


def test_refind_after_hysteresis_opens_a_new_incident(store: Store) -> None:
    t = tracker(store, "late")
    [opened] = t.observe([finding("late")], T0)
    t.observe([], T0 + 30 * S)
    [again] = t.observe([finding("late")], T0 + 150 * S)  # 120 s after resolving
    assert again.kind is TransitionKind.OPENED
    assert again.incident.incident_id != opened.incident.incident_id
    assert [r[1] for r in current(store, "late")] == ["resolved", "open"]


def test_severity_escalates_and_never_drops(store: Store) -> None:
    t = tracker(store, "esc")
    t.observe([finding("esc", severity=Severity.WARNING)], T0)
    [up] = t.observe([finding("esc", severity=Severity.CRITICAL)], T0 + S)
    assert up.kind is TransitionKind.ESCALATED and up.incident.severity is Severity.CRITICAL
    [same] = t.observe([finding("esc", severity=Severity.INFO)], T0 + 2 * S)
    assert same.kind is TransitionKind.UPDATED and same.incident.severity is Severity.CRITICAL
    assert current(store, "esc")[0][2] == int(Severity.CRITICAL)


def test_only_detectors_that_ran_resolve_their_incidents(store: Store) -> None:
    t = tracker(store, "slow")
    t.observe([finding("slow", detector="slowpoke")], T0)
    assert t.observe([], T0 + 60 * S, ran={"link"}) == []
    assert kinds(t.observe([], T0 + 61 * S, ran={"slowpoke"})) == [TransitionKind.RESOLVED]


def test_restart_resumes_without_duplicating(store: Store) -> None:
    first = tracker(store, "rs")
    [opened] = first.observe([finding("rs1"), finding("rs2")], T0)[:1]
    first.observe([], T0 + 30 * S, ran=set())  # nothing resolves: no detector ran
    second = tracker(store, "rs", T0 + 40 * S)
    assert {i.entity for i in second.open()} >= {"rs1", "rs2"}
    transitions = second.observe([finding("rs1"), finding("rs2")], T0 + 40 * S)
    assert kinds(transitions) == [TransitionKind.UPDATED, TransitionKind.UPDATED]
    assert transitions[0].incident.incident_id == opened.incident.incident_id
    assert transitions[0].incident.version == 2
    for entity in ("rs1", "rs2"):
        assert [(r[1], r[3], r[4]) for r in current(store, entity)] == [("open", 2, 2)]


def test_restart_within_hysteresis_still_reopens_the_same_incident(store: Store) -> None:
    first = tracker(store, "rsr")
    [opened] = first.observe([finding("rsr")], T0)
    first.observe([], T0 + 30 * S)
    second = tracker(store, "rsr", T0 + 60 * S)
    assert second.get(opened.incident.key, cluster="rsr") is not None
    [reopened] = second.observe([finding("rsr")], T0 + 60 * S)
    assert reopened.kind is TransitionKind.REOPENED
    assert reopened.incident.incident_id == opened.incident.incident_id


def test_table_keeps_every_version_and_final_reads_the_latest(store: Store) -> None:
    # A background merge may fold the versions at any moment, even between the inserts and the first read:
    # merges wait while the test reads every version.
    store.command("SYSTEM STOP MERGES incidents")
    try:
        t = tracker(store, "ver")
        [opened] = t.observe([finding("ver")], T0)
        t.observe([finding("ver")], T0 + S)
        t.observe([], T0 + 40 * S)
        iid = opened.incident.incident_id
        _, rows = store.query("SELECT Version, State FROM incidents WHERE IncidentId = {i:String} ORDER BY Version",
                              parameters={"i": iid})
        assert rows == [(1, "open"), (2, "open"), (3, "resolved")]
    finally:
        store.command("SYSTEM START MERGES incidents")
    store.command("OPTIMIZE TABLE incidents FINAL")
    _, rows = store.query("SELECT Version, State FROM incidents WHERE IncidentId = {i:String}", parameters={"i": iid})
    assert rows == [(3, "resolved")]


def test_a_failed_write_changes_nothing(store: Store) -> None:
    class Refusing(Store):
        def insert_columns(self, table: object, columns: object, *, token: str) -> None:  # type: ignore[override]
            raise RuntimeError("store refused")

    t = IncidentTracker(Refusing("chdb://unused"), clock=lambda: T0)
    t.loaded = True
    with pytest.raises(RuntimeError):
        t.observe([finding("nowrite")], T0)
    assert t.open() == []


def test_cluster_ddl_keeps_the_version_column() -> None:
    local, distributed = incidents_ddl(cluster="c1")
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/incidents_local', '{replica}', " \
           "Version)" in local
    assert "Distributed(`c1`, currentDatabase(), `incidents_local`" in distributed
    assert INCIDENTS.engine == "ReplacingMergeTree(Version)"
