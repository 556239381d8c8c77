"""GPU reads keyed by the GPU's own id (``hw.id``), with the GPU → host inventory kept between page loads.

Why: the metric tables are sorted by (service, metric, attributes, time), so a query about the last
minutes still reads every granule of the metric in the day's partition, and what it costs is mostly the
columns it reads. A row's host is in ``ResourceAttributes``, a wide map; every GPU row also names its GPU
in its own attributes (``hw.id``, the GPU's UUID, unique across a fleet). So the page-load queries read
only ``Attributes`` and key their answers by ``hw.id``, and `GpuInventory` maps ids to (host, index,
cluster): it is read whole now and then (a GPU moves host only when someone moves it), and an id it
does not know is looked up alone. Like `ridethrough.dashboards.queries`, every value is bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ridethrough.dashboards.queries import IN_RANGE, Points, SeriesKey, TimeRange, rows, series
from ridethrough.detectors.sql import NODE
from ridethrough.exporters.store import Store

GPU_ID = "hw.id"
STATE_RANK = {"failed": 3, "predicted_failure": 2, "degraded": 1, "ok": 0}


@dataclass(frozen=True, slots=True)
class GpuRef:
    """Where a GPU is: its host, its index there, and its host's cluster."""

    node: str
    index: str
    cluster: str


_INVENTORY = f"""
SELECT Attributes['{GPU_ID}'] AS id, argMax({NODE}, TimeUnix) AS node, argMax(Attributes['gpu.index'], TimeUnix) AS gpu,
       argMax(ResourceAttributes['ridethrough.cluster'], TimeUnix) AS cluster
FROM otel_metrics_gauge
WHERE MetricName = 'hw.status' AND TimeUnix >= fromUnixTimestamp64Nano({{since:Int64}}) AND id != ''
  AND ({{all_ids:Bool}} OR (hasAny(mapValues(Attributes), {{ids:Array(String)}}) AND id IN {{ids:Array(String)}}))
  AND ({{all_nodes:Bool}} OR (hasAny(mapValues(ResourceAttributes), {{nodes:Array(String)}})
                              AND {NODE} IN {{nodes:Array(String)}}))
GROUP BY id
"""


class GpuInventory:
    """hw.id → `GpuRef`, read from the store when needed; thread-safe.

    Every ``ttl_s`` it is read whole, from the last ``window_s`` (the GPUs reporting now; one partition).
    An id it does not know is looked up alone, as far back as ``lookup_window_s`` (the bloom filter on
    attribute values skips every granule without it), and an id found nowhere is not looked up again
    until the next whole read, so a departed GPU costs one lookup, not one per page load.
    """

    def __init__(self, *, ttl_s: float = 600.0, window_s: float = 3600.0, lookup_window_s: float = 8 * 86400.0,
                 retry_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s, self._window_s, self._lookup_window_s = ttl_s, window_s, lookup_window_s
        self._retry_s, self._clock = retry_s, clock
        self._refs: dict[str, GpuRef] = {}
        self._unknown: set[str] = set()
        self._read_at = -float("inf")
        self._nodes_read_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def prime(self, store: Store, *, now_ns: int | None = None) -> None:
        """Read the whole inventory now (a dashboard does it at start, so its first page loads find it)."""
        self.lookup(store, (), now_ns=time.time_ns() if now_ns is None else now_ns)

    def lookup(self, store: Store, ids: Collection[str], *, now_ns: int) -> dict[str, GpuRef]:
        """The refs of ``ids`` that the store knows (see the class docstring for when it reads)."""
        with self._lock:
            if self._clock() - self._read_at > self._ttl_s:
                self._refs = self._read(store, since_ns=now_ns - round(self._window_s * 1e9))
                self._unknown.clear()
                self._nodes_read_at.clear()
                self._read_at = self._clock()
            missing = sorted(i for i in ids if i not in self._refs and i not in self._unknown)
            if missing:
                found = self._read(store, since_ns=now_ns - round(self._lookup_window_s * 1e9), ids=missing)
                self._refs.update(found)
                self._unknown.update(set(missing) - found.keys())
            return {i: self._refs[i] for i in ids if i in self._refs}

    def ids_on(self, store: Store, nodes: Collection[str], *, now_ns: int,
               indexes: Collection[str] | None = None) -> list[str]:
        """The ids of the GPUs on ``nodes`` (those with one of ``indexes``, when given); the nodes' GPUs are
        looked up alone when none is known (at most every ``retry_s`` per node)."""
        def mine() -> list[str]:
            return sorted(i for i, ref in self._refs.items()
                          if ref.node in nodes and (indexes is None or ref.index in indexes))
        self.lookup(store, (), now_ns=now_ns)  # the whole read, when it is due
        with self._lock:
            found = mine()
            stale = [n for n in nodes if self._clock() - self._nodes_read_at.get(n, -float("inf")) > self._retry_s]
            if not found and stale:
                self._refs.update(self._read(store, since_ns=now_ns - round(self._lookup_window_s * 1e9),
                                             nodes=stale))
                self._nodes_read_at.update((n, self._clock()) for n in stale)
                found = mine()
            return found

    @staticmethod
    def _read(store: Store, *, since_ns: int, ids: Sequence[str] = (),
              nodes: Sequence[str] = ()) -> dict[str, GpuRef]:
        found = rows(store, _INVENTORY, {"since": since_ns, "all_ids": not ids, "ids": list(ids),
                                         "all_nodes": not nodes, "nodes": list(nodes)})
        return {r["id"]: GpuRef(r["node"], r["gpu"], r["cluster"]) for r in found}


_STATES = f"""
SELECT id, state FROM (
    SELECT Attributes['{GPU_ID}'] AS id, Attributes['hw.state'] AS state, argMax(Value, TimeUnix) AS v
    FROM otel_metrics_gauge WHERE MetricName = 'hw.status' AND {IN_RANGE}
    GROUP BY id, state
) WHERE v = 1
"""


def gpu_states(store: Store, *, now_ns: int, recent_s: float = 300.0, cluster: str = "",
               inventory: GpuInventory | None = None) -> dict[tuple[str, str], str]:
    """(node, GPU index) → its ``hw.state`` now (the state whose newest ``hw.status`` point in the last
    ``recent_s`` is 1; the worst when several are). Without an ``inventory`` it is read afresh."""
    rng = TimeRange(now_ns - round(recent_s * 1e9), now_ns)
    by_id: dict[str, str] = {}
    for r in rows(store, _STATES, rng.params()):
        if STATE_RANK.get(r["state"], 0) >= STATE_RANK.get(by_id.get(r["id"], "ok"), 0):
            by_id[r["id"]] = r["state"]
    refs = (inventory or GpuInventory(ttl_s=0)).lookup(store, by_id, now_ns=now_ns)
    out: dict[tuple[str, str], str] = {}
    for gpu_id, state in by_id.items():
        ref = refs.get(gpu_id)
        if ref is not None and (not cluster or ref.cluster == cluster):
            key = (ref.node, ref.index)
            if STATE_RANK.get(state, 0) >= STATE_RANK.get(out.get(key, "ok"), 0):
                out[key] = state
    return out


def gpu_metrics(store: Store, rng: TimeRange, metric: Mapping[str, str], *, inventory: GpuInventory,
                kind: str = "gauge", keys: Sequence[str] = (), match: Mapping[str, Sequence[str]] | None = None,
                nodes: Sequence[str] | None = None, cluster: str = "") -> dict[SeriesKey, Points]:
    """`queries.series` of GPU metrics, keyed by (node, metric, ``keys``...) as it would be, but read by GPU id
    (only ``Attributes``) and placed on its host through ``inventory``; ``nodes`` keeps those hosts' GPUs."""
    # One GPU's charts read the granules that hold its id only (the bloom filter on attribute values skips the rest).
    ids = None if nodes is None else inventory.ids_on(store, nodes, now_ns=rng.end_ns,
                                                      indexes=(match or {}).get("gpu.index"))
    if ids == []:
        return {}
    found = series(store, rng, metric, kind=kind, keys=keys, match=match, nodes=ids, node_attr=GPU_ID)
    refs = inventory.lookup(store, {k[0] for k in found}, now_ns=rng.end_ns)
    out: dict[SeriesKey, Points] = {}
    for key, points in found.items():
        ref = refs.get(key[0])
        if ref is not None and (not cluster or ref.cluster == cluster):
            out[(ref.node, *key[1:])] = points
    return out
