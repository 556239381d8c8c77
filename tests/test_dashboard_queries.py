"""Dashboard reads and the pure code behind the pages: known answers on hand-built rows, the fault roles of a
generated fleet, bound parameters, the result cache, config, basic auth and the command's start-up errors.

One chDB store per module (a process opens one store path): hand-built rows live in cluster ``exact``,
the generated fleet in cluster ``fake``, so they never see each other.
"""

from __future__ import annotations

import base64
import itertools
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner
from werkzeug.serving import make_server

from ridethrough.actuators.trace_view import SpanRow
from ridethrough.config import ConfigError
from ridethrough.dashboards import pages_fleet, pages_gpus, pages_incident, queries, queries_gpus, queries_incidents
from ridethrough.dashboards.app import route
from ridethrough.dashboards.config import DashboardConfig, SecretError, load_dashboard_config, read_password
from ridethrough.dashboards.fake_fleet import FakeFleet, FleetSpec, fabric_map, generate
from ridethrough.dashboards.pages_common import Context, natural_key, sparkline
from ridethrough.dashboards.pages_fabric_graph import link_states, topology
from ridethrough.dashboards.serve import BasicAuth, CachedStore, build_context, wsgi_app
from ridethrough.exporters import schema
from ridethrough.exporters.store import Store
from ridethrough.exporters.store_http import StoreHttpEndpoint

pytestmark = pytest.mark.integration

S = 10**9
END = 1_718_000_000 * S
"""The generated fleet's last moment (a fixed time: every answer below is exact)."""
SPEC = FleetSpec(hosts=8, hours=4, cluster="fake")
_tokens = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    st = Store(f"chdb://{tmp_path_factory.mktemp('dashboard') / 'store'}")
    st.init_schema()
    yield st
    st.close()


@pytest.fixture(scope="module")
def fleet(store: Store) -> FakeFleet:
    return generate(store, SPEC, end_ns=END)


def insert(store: Store, table: schema.Table, rows: Sequence[Mapping[str, Any]]) -> None:
    def default(typ: str) -> Any:
        return {} if typ.startswith("Map") else [] if typ.startswith("Array") else "" if "String" in typ else 0
    cols = [c for c in table.columns if c.insert]
    store.insert_columns(table, [[row.get(c.name, default(c.type)) for row in rows] for c in cols],
                         token=f"dashboard-test-{next(_tokens)}")


def point(node: str, metric: str, t_s: float, value: float, **attrs: str) -> dict[str, Any]:
    res = {"host.name": node, "ridethrough.node.id": node, "ridethrough.cluster": "exact"}
    return {"ResourceAttributes": res, "ServiceName": "ridethrough-agent", "MetricName": metric,
            "Attributes": attrs, "TimeUnix": END + round(t_s * S), "Value": value}


# --- time series: downsampling, counters, filters --------------------------------------------------------


def test_time_range_buckets_and_refuses_empty_ranges() -> None:
    rng = queries.TimeRange(0, 600 * S, 10)
    assert rng.step_ns == 60 * S
    assert queries.TimeRange(0, 5 * S, 100).step_ns == S  # never below a second
    with pytest.raises(ValueError, match="empty"):
        queries.TimeRange(5, 5)


def test_gauge_series_is_downsampled_in_sql(store: Store) -> None:
    insert(store, schema.GAUGE, [point("n1", "test.gauge", t, float(t), dev="a") for t in range(600)])
    found = queries.series(store, queries.TimeRange(END, END + 600 * S, 10), "test.gauge", keys=("dev",),
                           cluster="exact")
    times, values = found[("n1", "a")]
    assert times == [END + i * 60 * S for i in range(10)]
    assert values == [i * 60 + 29.5 for i in range(10)]  # the mean of each minute's 60 points
    maxed = queries.series(store, queries.TimeRange(END, END + 600 * S, 2), "test.gauge", agg="max", cluster="exact")
    assert maxed[("n1",)][1] == [299.0, 599.0]


def test_counter_series_is_increase_per_second_ignoring_resets_and_duplicates(store: Store) -> None:
    values = [0, 10, 20, 30, 5, 15, 25, 35]  # a reset after 30: the drop counts nothing, the climb after it does
    rows = [point("n1", "test.counter", 10 * i, v, dev="a") for i, v in enumerate(values)]
    insert(store, schema.SUM, rows)
    insert(store, schema.SUM, rows)  # a retried batch under another token: stored twice, counted once
    found = queries.series(store, queries.TimeRange(END, END + 80 * S, 4), "test.counter", kind="counter",
                           keys=("dev",), cluster="exact")
    # buckets of 20 s keep their last value (10, 30, 15, 35); the steps between them are 20, -15 (a reset: 0), 20
    assert found[("n1", "a")][1] == [0.0, 1.0, 0.0, 1.0]


def test_series_filters_nodes_attributes_and_clusters(store: Store) -> None:
    insert(store, schema.GAUGE, [point(n, "test.filter", 1, 1.0, dev=d) for n in ("n1", "n2") for d in ("a", "b")])
    rng = queries.TimeRange(END, END + 10 * S, 1)
    assert set(queries.series(store, rng, "test.filter", keys=("dev",), cluster="exact")) == {
        ("n1", "a"), ("n1", "b"), ("n2", "a"), ("n2", "b")}
    assert set(queries.series(store, rng, "test.filter", keys=("dev",), nodes=["n2"], match={"dev": ["b"]},
                              cluster="exact")) == {("n2", "b")}
    assert queries.series(store, rng, "test.filter", cluster="elsewhere") == {}
    insert(store, schema.GAUGE, [point("server", "test.attr_node", 1, 7.0, **{"clock.node": "n5"})])
    assert queries.series(store, rng, "test.attr_node", node_attr="clock.node", nodes=["n5"],
                          cluster="exact") == {("n5",): ([END], [7.0])}


HOSTILE = "x' OR 1=1) --"


def test_values_travel_as_parameters_never_as_sql(store: Store, fleet: FakeFleet) -> None:
    rng = queries.TimeRange(END - 3600 * S, END)
    assert queries.series(store, rng, HOSTILE) == {}
    assert queries.series(store, rng, "hw.temperature", keys=(HOSTILE,), nodes=[HOSTILE],
                          match={HOSTILE: [HOSTILE]}) == {}
    assert queries_incidents.incidents(store, incident_id=HOSTILE) == []
    assert queries_incidents.incident_of_trace(store, HOSTILE) is None
    assert queries_incidents.actions(store, incident_id=HOSTILE, cluster=HOSTILE) == []
    with pytest.raises(ValueError, match="unknown series kind"):
        queries.series(store, rng, "hw.temperature", agg="sum(Value)); DROP TABLE incidents; --")
    with pytest.raises(ValueError, match="direction"):
        queries.owd_matrix(store, rng, direction=HOSTILE)


# --- the generated fleet's faults, as the pages read them --------------------------------------------------


def test_fleet_health_shows_each_fault_at_its_host(store: Store, fleet: FakeFleet) -> None:
    roles = fleet.roles
    found = {(r["node"], r["what"]): r for r in queries.fleet_health(store, now_ns=END, cluster="fake")}
    assert found[(f"h{roles['gpu_failed']}", "gpu")]["level"] == 2
    assert found[(f"h{roles['gpu_failed']}", "gpu")]["detail"] == "gpu5 failed"
    assert found[(f"h{roles['gpu_failing']}", "gpu")]["detail"] == "gpu2 predicted_failure"
    assert found[(f"h{roles['clock']}", "clock")]["level"] == 2
    healthy = f"h{roles['link_down']}"  # its outage ended 25 minutes ago
    assert [found[(healthy, w)]["level"] for w in ("gpu", "nic", "clock")] == [0, 0, 0]
    hosts, levels, _ = pages_fleet.health_matrix(list(found.values()), now_ns=END, stale_s=90)
    agent = dict(zip(hosts, levels[pages_fleet.COLUMNS.index("agent")], strict=True))
    assert agent[f"h{roles['silent']}"] == 2 and agent[healthy] == 0  # silent for 10 min; a minute's interval is fine
    during = {(r["node"], r["what"]): r for r in queries.fleet_health(store, now_ns=END - 30 * 60 * S, cluster="fake")}
    assert during[(healthy, "nic")]["detail"] == "nic1 down" and during[(healthy, "nic")]["level"] == 2


def test_gpu_states_and_table_rows_put_the_worst_gpu_first(store: Store, fleet: FakeFleet) -> None:
    states = queries_gpus.gpu_states(store, now_ns=END, cluster="fake")
    assert len(states) == SPEC.hosts * SPEC.gpus - SPEC.gpus  # the silent host's GPUs have no state now
    assert states[(f"h{fleet.roles['gpu_failed']}", "5")] == "failed"
    rng = queries.TimeRange(END - 4 * 3600 * S, END, 24)
    ctx = Context(store=store, cfg=DashboardConfig(cluster="fake"))
    temp, throttle, ecc, xid = pages_gpus.gpu_series(ctx, rng, per_code=False)
    rows = pages_gpus.gpu_rows(temp, throttle, ecc, xid, states, step_s=rng.step_ns / 1e9)
    assert [r["state"] for r in rows[:2]] == ["failed", "predicted_failure"]
    failed, failing = rows[0], rows[1]
    assert (failed["ecc_uncorrected"], failed["xids"]) == (2, 1)  # XID 79, three hours ago
    assert failing["gpu"] == f"h{fleet.roles['gpu_failing']}/gpu2" and failing["ecc_corrected"] > 100
    assert failing["xids"] == 3 and failing["throttled_pct"] > 40  # one XID 63 an hour; hot for the last two
    assert failing["temp_max"] > 75 and len(failing["temp_spark"]) == 24
    codes = pages_gpus.gpu_series(ctx, rng, per_code=True, nodes=[failed["gpu"].split("/")[0]])[3]
    assert set(codes) == {(failed["gpu"].split("/")[0], "5", "79")}


class _CountingStore:
    """The store, counting the GPU inventory's reads (the only query that reads the hosts' cluster)."""

    def __init__(self, store: Store) -> None:
        self.store, self.inventory_reads = store, 0

    def query(self, sql: str, **kw: Any) -> Any:
        self.inventory_reads += "ridethrough.cluster'], TimeUnix)" in sql
        return self.store.query(sql, **kw)


def test_the_gpu_inventory_is_read_whole_once_and_then_only_what_it_does_not_know(store: Store,
                                                                                  fleet: FakeFleet) -> None:
    counting, now = _CountingStore(store), [0.0]
    inventory = queries_gpus.GpuInventory(ttl_s=600, clock=lambda: now[0])
    read: Any = counting  # duck-typed: the inventory only queries
    first = queries_gpus.gpu_states(read, now_ns=END, cluster="fake", inventory=inventory)
    assert first == queries_gpus.gpu_states(store, now_ns=END, cluster="fake") and counting.inventory_reads == 1
    assert queries_gpus.gpu_states(read, now_ns=END, cluster="fake", inventory=inventory) == first
    assert counting.inventory_reads == 1  # nothing new: no read
    assert inventory.lookup(read, ["GPU-nowhere"], now_ns=END) == {} and counting.inventory_reads == 2
    assert inventory.lookup(read, ["GPU-nowhere"], now_ns=END) == {} and counting.inventory_reads == 2  # remembered
    failed = f"h{fleet.roles['gpu_failed']}"
    (gpu_id,) = inventory.ids_on(read, [failed], now_ns=END, indexes=["5"])
    assert inventory.lookup(read, [gpu_id], now_ns=END)[gpu_id] == queries_gpus.GpuRef(failed, "5", "fake")
    assert inventory.ids_on(read, ["h99"], now_ns=END) == [] and counting.inventory_reads == 3  # looked for, once
    assert inventory.ids_on(read, ["h99"], now_ns=END) == [] and counting.inventory_reads == 3
    now[0] += 601
    assert queries_gpus.gpu_states(read, now_ns=END, cluster="other", inventory=inventory) == {}  # not its cluster
    assert counting.inventory_reads == 4  # read whole again after ttl_s


def test_one_scan_reads_several_metrics_each_with_its_aggregate(store: Store) -> None:
    insert(store, schema.GAUGE, [point("n1", "test.a", t, float(t)) for t in range(4)]
           + [point("n1", "test.b", t, 10.0 * t) for t in range(4)])
    found = queries.series(store, queries.TimeRange(END, END + 4 * S, 1), {"test.a": "max", "test.b": "min"},
                           cluster="exact")
    assert found == {("n1", "test.a"): ([END], [3.0]), ("n1", "test.b"): ([END], [0.0])}


def test_incidents_read_as_their_newest_version(store: Store, fleet: FakeFleet) -> None:
    every = queries_incidents.incidents(store, cluster="fake")
    assert len(every) == len(fleet.incidents) and every[0].state.value == "open"
    down = queries_incidents.incident(store, fleet.incidents["link_down"])
    assert down is not None and down.state.value == "resolved" and down.version == 2
    assert queries_incidents.incident_of_trace(store, fleet.traces["link_down"]) == down
    open_ids = {i.incident_id for i in queries_incidents.incidents(store, cluster="fake", open_only=True)}
    assert fleet.incidents["link_down"] not in open_ids and fleet.incidents["gpu_failed"] in open_ids
    later = queries_incidents.incidents(store, start_ns=END + 3600 * S, end_ns=END + 7200 * S, cluster="fake")
    assert {i.incident_id for i in later} == open_ids  # resolved ones ended before that range
    assert queries_incidents.incidents(store, cluster="another") == []


def test_actions_by_incident_and_since(store: Store, fleet: FakeFleet) -> None:
    acted = queries_incidents.actions(store, incident_id=fleet.incidents["gpu_failed"])
    assert [(a.plugin, a.status.value) for a in acted] == [("migrate", "succeeded")]
    assert len(queries_incidents.actions(store, cluster="fake")) == 3
    assert queries_incidents.actions(store, since_ns=END) == []


def test_missing_domain_tables_read_as_empty(store: Store, fleet: FakeFleet) -> None:
    store.command("RENAME TABLE incidents TO incidents_away, actions TO actions_away")
    try:
        assert queries_incidents.incidents(store) == []
        assert queries_incidents.actions(store) == []
    finally:
        store.command("RENAME TABLE incidents_away TO incidents, actions_away TO actions")


def test_fabric_reads_show_congestion_and_the_bad_nics(store: Store, fleet: FakeFleet) -> None:
    rng = queries.TimeRange(END - 1800 * S, END)
    hot = fleet.spec.hosts // fleet.spec.racks * ((fleet.spec.racks - 1) // 2)
    forward = {(r["src"], r["dst"]): r["owd_s"] for r in queries.owd_matrix(store, rng, direction="forward")}
    reverse = {(r["src"], r["dst"]): r["owd_s"] for r in queries.owd_matrix(store, rng, direction="reverse")}
    into_hot = [k for k in forward if k[1] == f"h{hot}"]
    assert into_hot and all(forward[k] > 35e-6 for k in into_hot) and all(reverse[k] < 20e-6 for k in into_hot)
    recent = queries.nic_state(store, queries.TimeRange(END - 1200 * S, END))  # after the outage's error burst
    degrading = f"h{fleet.roles['link_degrading']}/nic0"
    assert max(recent, key=lambda n: recent[n].get("errors", 0.0)) == degrading
    down = queries.nic_state(store, queries.TimeRange(END - 3600 * S, END))[f"h{fleet.roles['link_down']}/nic1"]
    assert down["min_up"] == 0.0 and down["up"] == 1.0 and down["errors"] >= 400
    assert queries.customers(store, rng) == ["acme", "globex"]


def test_recent_gauge_reads_take_the_metric_time_projection_and_answer_as_the_table_does(
        store: Store, fleet: FakeFleet) -> None:
    rng = queries.TimeRange(END - 1800 * S, END)
    owd = rng.params(fleet.spec.cluster, direction="forward")
    _, plan = store.query("EXPLAIN projections = 1 " + queries._OWD, parameters=owd)
    assert any("by_metric_time" in r[0] for r in plan)  # the last half hour, not the day of every series
    health = rng.params(fleet.spec.cluster, seen=END - 3600 * S, clock_warn=queries.CLOCK_WARN_S,
                        clock_bad=queries.CLOCK_BAD_S)
    for sql, params in ((queries._OWD, owd), (queries._NIC_UP, rng.params(fleet.spec.cluster)),
                        (queries._HEALTH, health)):
        _, read = store.query(sql, parameters=params)
        _, table = store.query(sql, parameters=params, settings={"optimize_use_projections": 0})
        assert read and sorted(read) == sorted(table)


def test_topology_of_the_fleet_and_link_levels(fleet: FakeFleet) -> None:
    topo = topology(fabric_map(fleet.spec))
    kinds = [v[2] for v in topo.nodes.values()]
    assert (kinds.count("host"), kinds.count("nic"), kinds.count("switch")) == (8, 16, 8 * 2 + 4)
    assert topo.links["h3-leaf3r1"] == ("h3/mlx5_1", "leaf3r1")  # drawn from its first NIC name
    assert topo.link_nics["h3-leaf3r1"] == ("h3/mlx5_1", "h3/nic1", "leaf3r1/h3")  # the leaf's port too
    assert topo.link_nics["leaf3r1-spine2"] == ("leaf3r1/spine2", "spine2/leaf3r1")
    assert max(v[1] for v in topo.nodes.values()) == 3  # spines sit above the leaves
    levels, _, rates = link_states(topo, {"h3/nic1": {"up": 0.0, "errors": 10.0}, "h2/nic0": {"errors": 36.0}},
                                   seconds=3600, bad_links={"h5-leaf5r0": 1})
    assert (levels["h3-leaf3r1"], levels["h2-leaf2r0"], levels["h5-leaf5r0"], levels["h1-leaf1r0"]) == (2, 1, 1, 0)
    assert rates["h2-leaf2r0"] == pytest.approx(0.01)


# --- the result cache -----------------------------------------------------------------------------------------


def test_cached_store_reuses_results_until_they_expire(store: Store) -> None:
    now = [0.0]
    with StoreHttpEndpoint(client=store.client(), host="127.0.0.1", port=0, lock=store.lock) as served:
        cached = CachedStore("http://{}:{}".format(*served.address), ttl_s=10, clock=lambda: now[0])
        sql = "SELECT count() FROM otel_metrics_gauge WHERE MetricName = {m:String}"
        assert cached.query(sql, parameters={"m": "test.cache"})[1] == [(0,)]
        insert(store, schema.GAUGE, [point("n1", "test.cache", 0, 1.0)])
        assert cached.query(sql, parameters={"m": "test.cache"})[1] == [(0,)]  # fresh for 10 s
        assert cached.query(sql, parameters={"m": "test.cache", "x": 1})[1] == [(1,)]  # other values: another query
        now[0] = 10.0
        assert cached.query(sql, parameters={"m": "test.cache"})[1] == [(1,)]
        cached.close()
        uncached = CachedStore("http://{}:{}".format(*served.address), ttl_s=0)
        assert not queries.table_exists(uncached, "test_later")
        store.command("CREATE TABLE test_later (x UInt8) ENGINE = Memory")
        assert queries.table_exists(uncached, "test_later")  # a missing table is asked about again ...
        store.command("DROP TABLE test_later")
        assert queries.table_exists(uncached, "test_later")  # ... one found is remembered
        assert uncached.query(sql, parameters={"m": "test.cache"})[1] == [(1,)]
        insert(store, schema.GAUGE, [point("n1", "test.cache", 1, 1.0)])
        assert uncached.query(sql, parameters={"m": "test.cache"})[1] == [(2,)]  # ttl 0: never reused
        uncached.close()


# --- pure page code --------------------------------------------------------------------------------------------


def test_sparklines_and_natural_order() -> None:
    assert sparkline([]) == "" and sparkline([3, 3]) == "▁▁" and sparkline([0, 7, 3.5]) == "▁█▅"
    assert sorted(["h10", "h2", "h1"], key=natural_key) == ["h1", "h2", "h10"]


def span(sid: str, parent: str, start: int) -> SpanRow:
    return SpanRow(sid, parent, f"s{sid}", "svc", start, 10, "Ok", "", {})


def test_waterfall_order_is_a_tree_and_survives_orphans_and_cycles() -> None:
    spans = [span("a", "", 0), span("c", "a", 5), span("b", "a", 2), span("d", "b", 3), span("o", "zz", 1),
             span("x", "y", 9), span("y", "x", 8)]  # a cycle, with no way in: drawn nowhere, raises nothing
    order = [(depth, s.span_id) for depth, s in pages_incident.tree(spans)]
    assert order == [(0, "a"), (1, "b"), (2, "d"), (1, "c"), (0, "o")]
    fig = pages_incident.waterfall(spans[:5])
    assert list(fig.data[0].base) == [0.0, 2e-6, 3e-6, 5e-6, 1e-6]


def test_router_serves_every_page_and_pagerduty_paths(store: Store) -> None:
    ctx = Context(store=store, cfg=DashboardConfig())
    assert "incident-ref" in str(route(ctx, "/incidents/abc"))
    assert "'trace': 'f00d'" in str(route(ctx, "/traces/f00d/"))
    for path, marker in (("/", "fleet-health"), ("/fabric", "fabric-owd"), ("/gpus", "gpu-table"),
                         ("/incidents", "incidents-timeline"), ("/goodput", "goodput-jobs")):
        assert marker in str(route(ctx, path)), path
    assert "not-found" in str(route(ctx, "/nope"))


def test_a_fresh_threaded_server_serves_scripts_to_concurrent_first_requests() -> None:
    # A gunicorn worker's first requests may be for scripts (the page came from another worker), several at once.
    server = make_server("127.0.0.1", 0, wsgi_app(build_context(DashboardConfig(), dsn="http://127.0.0.1:1")),
                         threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/_dash-component-suites/dash/dcc/async-graph.js"

    def status(_: int) -> int:
        try:
            with urllib.request.urlopen(url, timeout=30) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as err:
            return err.code

    try:
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(status, range(8))) == [200] * 8
    finally:
        server.shutdown()


class _Callbacks:
    """Collects the functions a page registers (a stand-in for `dash.Dash.callback` that only records)."""

    def __init__(self) -> None:
        self.functions: list[Any] = []

    def callback(self, *args: Any, **kwargs: Any) -> Any:
        def record(fn: Any) -> Any:
            self.functions.append(fn)
            return fn
        return record


def test_a_store_that_is_away_is_a_message_not_a_broken_page() -> None:
    ctx = Context(store=CachedStore("http://127.0.0.1:1", ttl_s=0, timeout_s=1), cfg=DashboardConfig())
    app = _Callbacks()
    pages_fleet.register(app, ctx)  # type: ignore[arg-type]  # records the callbacks, serves nothing
    figure, incidents, actions, message = app.functions[0]("/", 0)
    assert "store unavailable" in str(figure.layout.annotations[0].text)
    assert (incidents, actions) == ("", "") and "unreachable" in str(message)


# --- config, secrets, basic auth, the command ------------------------------------------------------------------


def test_config_layers_and_checks(tmp_path: Path) -> None:
    file = tmp_path / "rt.yaml"
    file.write_text("dashboard:\n  listen: 0.0.0.0:9000\n  refresh_s: 5\ngateway:\n  store: chdb://x\n")
    loaded = load_dashboard_config(file=file, env={"RIDETHROUGH_DASHBOARD_REFRESH_S": "7"}, flags={"workers": 3})
    assert (loaded.config.listen, loaded.config.refresh_s, loaded.config.workers) == ("0.0.0.0:9000", 7.0, 3)
    with pytest.raises(ConfigError, match="did you mean RIDETHROUGH_DASHBOARD_REFRESH_S"):
        load_dashboard_config(env={"RIDETHROUGH_DASHBOARD_REFRES_S": "1"})
    with pytest.raises(ConfigError, match="go together"):
        load_dashboard_config(flags={"basic_auth_user": "sre"})
    with pytest.raises(ConfigError, match="never goes in the config") as err:
        load_dashboard_config(flags={"basic_auth_user": "sre", "basic_auth_password": "hunter2"})
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="server"):
        load_dashboard_config(flags={"server": "apache"})


def test_passwords_come_from_env_or_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    assert read_password(f"file:{tmp_path / 'pw'}") == "s3cret"
    assert read_password("env:PW", {"PW": " s3cret "}) == "s3cret"
    for ref, message in (("env:NOPE", "not set"), (f"file:{tmp_path / 'none'}", "cannot read"), ("env:E", "empty")):
        with pytest.raises(SecretError, match=message):
            read_password(ref, {"E": " "})


def call(app: Any, path: str, authorization: str = "") -> tuple[str, dict[str, str]]:
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        got.update(status=status, headers=dict(headers))

    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    if authorization:
        environ["HTTP_AUTHORIZATION"] = authorization
    b"".join(app(environ, start_response))
    return got["status"], got["headers"]


def test_basic_auth_guards_everything_but_health() -> None:
    def inner(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"ok"]

    app = BasicAuth(inner, user="sre", password="pw:with:colons")
    good = "Basic " + base64.b64encode(b"sre:pw:with:colons").decode()
    assert call(app, "/", good)[0] == "200 OK"
    assert call(app, "/healthz")[0] == "200 OK"
    status, headers = call(app, "/")
    assert status.startswith("401") and headers["WWW-Authenticate"].startswith("Basic realm=")
    for bad in ("Basic " + base64.b64encode(b"sre:nope").decode(), "Basic !!!", "Bearer x", "Basic " +
                base64.b64encode(b"sre").decode()):
        assert call(app, "/_dash-layout", bad)[0].startswith("401"), bad


def test_command_stops_at_start_on_bad_config_or_map(tmp_path: Path) -> None:
    import typer

    from ridethrough.dashboards.dashboard_cli import dashboard

    cli = typer.Typer()
    cli.command()(dashboard)
    runner = CliRunner()
    bad = runner.invoke(cli, ["--listen", "nowhere", "--store", "http://127.0.0.1:1"])
    assert bad.exit_code == 2 and "listen" in bad.output
    (tmp_path / "map.json").write_text('{"routes": {"nonsense": []}}')
    bad_map = runner.invoke(cli, ["--store", "http://127.0.0.1:1", "--fabric-map-file", str(tmp_path / "map.json"),
                                  "--listen", "127.0.0.1:0"])
    assert bad_map.exit_code == 2 and "route map" in bad_map.output
