"""LastHeard: each node's newest point, kept from the batches the gateway writes (the live feed).

The silence detector asks one question every few seconds: when was each node last heard from?
From the store that is a scan of the recent time column of every telemetry table, the costliest
query the controller makes on a busy store; the gateway already holds the answer in each batch
it writes. A `LastHeard` attached to the live feed keeps it in memory: per node, the newest
point time and its host name, per cluster.

It only knows what was written since it was attached, so its user reads the store once first
(`ridethrough.detectors.silent.AgentSilent` does) and keeps the newer of the two.
"""

from __future__ import annotations

import threading

from ridethrough.exporters.ingest_auth import CLUSTER_ATTRIBUTE
from ridethrough.exporters.rows import Rows
from ridethrough.exporters.schema import GAUGE, LOGS, SUM

NODE_ID = "ridethrough.node.id"
HOST_NAME = "host.name"

_TIME_COLUMNS = ((GAUGE.name, "TimeUnix"), (SUM.name, "TimeUnix"), (LOGS.name, "Timestamp"))
"""The tables `ridethrough.detectors.silent`'s store query reads, and each one's point time."""

class LastHeard:
    """Per cluster and node, the newest point time written (a pipeline observer; thread-safe).

    A node is its ``ridethrough.node.id``, else its ``host.name`` (as in the store queries); rows
    with neither are not counted. ``attached`` says whether a feed calls it: only then is it
    worth asking.
    """

    def __init__(self) -> None:
        self._by_cluster: dict[str, dict[str, tuple[int, str]]] = {}
        self._lock = threading.Lock()
        self.attached = False

    def __call__(self, rows: Rows) -> None:
        """Take the newest point per node from one written batch."""
        newest: dict[tuple[str, str], tuple[int, str]] = {}
        for table, time_col in _TIME_COLUMNS:
            cols = rows.columns.get(table)
            if not cols:
                continue
            last_res: object = None
            key = ("", "")
            host = ""
            best = -1
            # A converter repeats one resource object for all of a request's points, so the node is looked up
            # once per run of rows that share it, not once per row.
            for res, t in zip(cols["ResourceAttributes"], cols[time_col], strict=True):
                if res is not last_res:
                    if best >= 0:
                        _keep(newest, key, best, host)
                    last_res, best = res, -1
                    node = res.get(NODE_ID) or res.get(HOST_NAME, "")
                    key, host = (res.get(CLUSTER_ATTRIBUTE, ""), node), res.get(HOST_NAME, "")
                if t > best:
                    best = t
            if best >= 0:
                _keep(newest, key, best, host)
        with self._lock:
            for (cluster, node), (t, host) in newest.items():
                if not node:
                    continue
                nodes = self._by_cluster.setdefault(cluster, {})
                if t > nodes.get(node, (-1, ""))[0]:
                    nodes[node] = (t, host)

    def snapshot(self, cluster: str = "") -> dict[str, tuple[int, str]]:
        """node → (newest ns, host) of ``cluster`` (every cluster's for "": a node in two keeps its newest)."""
        with self._lock:
            if cluster:
                return dict(self._by_cluster.get(cluster, {}))
            out: dict[str, tuple[int, str]] = {}
            for nodes in self._by_cluster.values():
                for node, seen in nodes.items():
                    if seen[0] > out.get(node, (-1, ""))[0]:
                        out[node] = seen
            return out


def _keep(newest: dict[tuple[str, str], tuple[int, str]], key: tuple[str, str], t: int, host: str) -> None:
    if t > newest.get(key, (-1, ""))[0]:
        newest[key] = (t, host)
