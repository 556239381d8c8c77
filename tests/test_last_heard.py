"""LastHeard and the silence detector that follows the live feed: no store query after the first."""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from ridethrough.detectors.contract import FindingKind, Window
from ridethrough.detectors.controller import Controller
from ridethrough.detectors.heard import LastHeard
from ridethrough.detectors.incidents import IncidentTracker
from ridethrough.detectors.link import LinkDown
from ridethrough.detectors.live import LiveFeed, runs_live
from ridethrough.detectors.silent import AgentSilent
from ridethrough.exporters.convert_metrics import convert_metrics
from ridethrough.exporters.convert_spans_logs import convert_logs
from ridethrough.exporters.rows import Limits, Rejections, Rows, kv
from ridethrough.exporters.store import Store
from ridethrough.settings import GatewayConfig, ServerConfig
from ridethrough.wiring import ServerRuntime

S = 10**9
T0 = 1_700_000_000 * S


def _resource(node: str | None, host: str | None, cluster: str) -> list[Any]:
    attrs = [kv("ridethrough.cluster", cluster)]
    if node is not None:
        attrs.append(kv("ridethrough.node.id", node))
    if host is not None:
        attrs.append(kv("host.name", host))
    return attrs


def metrics(*senders: tuple[str | None, str | None, str, list[int]], kind: str = "gauge") -> Rows:
    """Converted rows: per sender (node id, host name, cluster, point times) one resource of gauge (or sum)
    points."""
    req = ExportMetricsServiceRequest()
    for node, host, cluster, times in senders:
        rm = req.resource_metrics.add()
        rm.resource.attributes.extend(_resource(node, host, cluster))
        metric = rm.scope_metrics.add().metrics.add(name="ridethrough.nic.up", unit="1")
        data = metric.gauge if kind == "gauge" else metric.sum
        for t in times:
            data.data_points.add(time_unix_nano=t, start_time_unix_nano=T0 if kind == "sum" else 0, as_double=1.0)
        if kind == "sum":
            metric.sum.aggregation_temporality = 2
            metric.sum.is_monotonic = True
    rows, rej = Rows(), Rejections()
    convert_metrics(req, Limits(), rows, rej)
    assert rej.count == 0, rej.message()
    return rows


def logs(node: str, cluster: str, times: list[int]) -> Rows:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.extend(_resource(node, node, cluster))
    for t in times:
        rl.scope_logs.add().log_records.add(time_unix_nano=t).body.string_value = "step"
    rows, rej = Rows(), Rejections()
    convert_logs(req, Limits(), rows, rej)
    assert rej.count == 0, rej.message()
    return rows


def test_keeps_each_nodes_newest_point_per_cluster_from_every_table() -> None:
    heard = LastHeard()
    heard(metrics(("a", "host-a", "c1", [T0 + 3 * S, T0 + 1 * S]), (None, "b", "c1", [T0 + 2 * S]),
                  ("a", "host-a", "c2", [T0 + 9 * S])))
    heard(metrics(("a", "host-a", "c1", [T0 + 2 * S]), kind="sum"))  # older: kept the newer
    heard(logs("b", "c1", [T0 + 5 * S]))
    heard(metrics((None, None, "c1", [T0 + 50 * S])))  # names no node: not one
    heard(Rows())
    assert heard.snapshot("c1") == {"a": (T0 + 3 * S, "host-a"), "b": (T0 + 5 * S, "b")}
    assert heard.snapshot("c2") == {"a": (T0 + 9 * S, "host-a")}
    assert heard.snapshot("") == {"a": (T0 + 9 * S, "host-a"), "b": (T0 + 5 * S, "b")}  # every cluster's newest
    assert heard.snapshot("nowhere") == {}


class CountingQuery:
    """A Window.query answering the silence detector's store query with fixed rows, counting its calls."""

    def __init__(self, rows: list[tuple[str, str, int]]) -> None:
        self.rows = rows
        self.calls = 0

    def __call__(self, sql: str, params: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
        self.calls += 1
        return ["node", "host", "last_ns"], list(self.rows)


def _window(query: CountingQuery, end_ns: int, window_s: float = 3600.0) -> Window:
    return Window(start_ns=end_ns - int(window_s * S), end_ns=end_ns, query=query, cluster="c1")


def test_following_the_feed_it_reads_the_store_once_and_then_only_what_the_feed_gave() -> None:
    det = AgentSilent(silent_after_s=30.0)
    assert not det.live
    heard = det.follow_feed()
    assert det.live and heard.attached
    # the store knows what came before the feed: "old" has been quiet for 40 s, "a" and "b" are fresh
    query = CountingQuery([("a", "a", T0), ("b", "b", T0), ("old", "old", T0 - 40 * S)])
    found = det.detect(_window(query, T0 + 1 * S))
    assert [f.entity for f in found] == ["old"] and query.calls == 1
    # from here on the feed: "b" stops, "a" goes on; nothing asks the store
    for i in range(1, 41):
        heard(metrics(("a", "a", "c1", [T0 + i * S]), *([("b", "b", "c1", [T0 + i * S])] if i <= 5 else [])))
    found = det.detect(_window(query, T0 + 41 * S))
    assert query.calls == 1
    assert {f.entity: round(f.evidence["silent_s"]) for f in found} == {"b": 35, "old": 80}
    assert all(f.kind is FindingKind.AGENT_SILENT for f in found)
    heard(metrics(("b", "b", "c1", [T0 + 41 * S]), ("old", "old", "c1", [T0 + 41 * S])))  # both back
    assert det.detect(_window(query, T0 + 42 * S)) == [] and query.calls == 1
    # a window that does not follow on (time went back) is read from the store in full again
    det.detect(_window(query, T0 - 100 * S))
    assert query.calls == 2


def test_without_a_feed_it_reads_the_store_every_run() -> None:
    det = AgentSilent(silent_after_s=30.0)
    query = CountingQuery([("a", "a", T0), ("b", "b", T0 - 40 * S)])
    assert [f.entity for f in det.detect(_window(query, T0 + S))] == ["b"]
    assert [f.entity for f in det.detect(_window(query, T0 + 2 * S))] == ["b"]
    assert query.calls == 2


class Broken:
    """A detector whose feed observer raises."""

    name = "broken"
    interval_s = 5.0
    window_s = 60.0

    def detect(self, window: Window) -> list[Any]:
        return []

    def follow_feed(self) -> Any:
        def observe(rows: Rows) -> None:
            raise RuntimeError("a follower's bug")
        return observe


def test_the_feed_joins_the_silence_detector_to_the_live_lane_and_survives_a_raising_follower(
        tmp_path: Any) -> None:
    store = Store(f"chdb://{tmp_path / 'store'}")  # the controller is built, never run: nothing is queried
    try:
        silent, link = AgentSilent(), LinkDown()
        controller = Controller(store=store, detectors=[Broken(), silent, link], tracker=IncidentTracker(store))
        assert controller.lanes["live"] == {"link_down"}  # without a feed the silence detector queries the store
        woken: list[list[str]] = []
        feed = LiveFeed(controller.detectors, wake=lambda names: woken.append(list(names)), min_gap_s=0.0)
        assert runs_live(silent) and not runs_live(Broken())
        assert controller.lanes == {"live": {"link_down", "agent_silent"}, "scheduled": {"broken"}}
        feed(metrics(("a", "a", "c1", [T0])))
        assert silent.follow_feed().snapshot("c1") == {"a": (T0, "a")}  # past the raising follower
        assert woken == []
    finally:
        store.close()


def test_the_servers_controller_runs_the_silence_detector_in_its_live_lane(tmp_path: Any) -> None:
    """Wired in the all-in-one server, the silence detector follows the gateway's feed (no store query per run)."""
    server = ServerRuntime(gateway_cfg=GatewayConfig(otlp_listen="127.0.0.1:0", store=f"chdb://{tmp_path / 'store'}",
                                                     spool=str(tmp_path / "spool")),
                           server_cfg=ServerConfig(store_http_listen="", clock_service=False, clock_listen=""))
    try:
        server.start()
        controller = server.controller
        assert controller is not None and "agent_silent" in controller.lanes["live"]
        silent = next(d for d in controller.detectors if d.name == "agent_silent")
        assert getattr(silent, "live", False) is True
    finally:
        server.stop()
