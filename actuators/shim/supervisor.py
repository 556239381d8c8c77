"""The launcher's loop: reap children, feed the coordinator, keep spares, stop when the job is over.

Each launcher reaps the children that exited (reported to the coordinator: directly on node 0,
through the store's event list elsewhere) as they exit: a child's exit (SIGCHLD) cuts the loop's
sleep short when the launcher runs in the main thread (else the other nodes poll every 10 ms).
Node 0 also reads the other nodes' events, the control requests, their heartbeats (a node silent
for ``heartbeat_s`` is lost), and ticks the coordinator and the periodic snapshots: every 50 ms
while nothing happens, every 5 ms while the coordinator is busy (an operation in flight or queued,
a failure reported), when each tick is on a recovery's path. Twice a second each launcher
replaces spares that took a rank or died (at most four times ``--spares`` starts over the job, so
a spare that cannot start does not loop for ever) and, on the other nodes, beats its heartbeat
and follows a restart or the shutdown node 0 posts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time
from typing import TYPE_CHECKING, Any

from ridethrough.actuators.shim import keys

if TYPE_CHECKING:
    from ridethrough.actuators.launcher import Launcher

log = logging.getLogger("ridethrough.actuators.launcher")
TICK_S = 0.05
"""Node 0's loop while the job just trains (each tick costs a few store round trips)."""
BUSY_TICK_S = 0.005
"""Node 0's loop while the coordinator is busy (`Coordinator.busy`): a plan waits on the tick."""
FOLLOWER_TICK_S = 0.01
"""The other nodes' loop without a SIGCHLD wake-up (reaping only; with one: `TICK_S`)."""
SLOW_S = 0.5


class _Waker:
    """Sleeps that a signal (a child's exit: SIGCHLD; a stop) cuts short, through Python's wake-up fd.

    Only the main thread may set it up; elsewhere `nap` is a plain sleep (``active`` is False).
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_fd = -1
        self._old_handler: Any = None
        try:
            self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
            # A Python handler (that does nothing) makes the C handler write to the wake-up fd.
            self._old_handler = signal.signal(signal.SIGCHLD, lambda signum, frame: None)
            self.active = True
        except ValueError:  # not the main thread (a launcher run by a test's thread)
            self.active = False

    def nap(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if a signal arrives."""
        if not self.active:
            time.sleep(seconds)
            return
        ready, _, _ = select.select([self._r], [], [], seconds)
        if ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._r, 512):
                    pass

    def close(self) -> None:
        """Put the previous handler and wake-up fd back."""
        if self.active:
            signal.signal(signal.SIGCHLD, self._old_handler)
            signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)


def supervise(launcher: Launcher) -> int:
    """Run until the job is over; the launcher's exit status."""
    waker = _Waker()
    try:
        return _supervise(launcher, waker)
    finally:
        waker.close()


def _supervise(launcher: Launcher, waker: _Waker) -> int:
    started = time.monotonic()
    slow_at = [started]
    while True:
        if launcher._stopping:
            return 128 + launcher._stopping
        if launcher.coordinator is not None:
            code = _tick(launcher, slow_at)
            code = code if code is not None else _lead(launcher, started)
            if code is not None:
                _shutdown(launcher, code)
                return code
        else:
            try:  # a follower outlives nothing: without node 0's store it stops
                code = _tick(launcher, slow_at)
            except RuntimeError as exc:  # torch's store errors (DistNetworkError) are RuntimeErrors
                log.error("lost the job store (node 0 is gone?): %s; stopping this node", exc)
                return 1
            if code is not None:
                launcher.store.add(keys.SHUTDOWN + "/acks", 1)
                return code
        waker.nap(_nap(launcher, woken=waker.active))


def _nap(launcher: Launcher, *, woken: bool) -> float:
    c = launcher.coordinator
    if c is None:
        return TICK_S if woken else FOLLOWER_TICK_S
    return BUSY_TICK_S if c.busy else TICK_S


def _tick(launcher: Launcher, slow_at: list[float]) -> int | None:
    """Reap; twice a second replace spares (and, on a follower, beat and follow node 0)."""
    _reap(launcher)
    now = time.monotonic()
    if now < slow_at[0]:
        return None
    slow_at[0] = now + SLOW_S
    _replenish(launcher)
    return _follow(launcher) if launcher.coordinator is None else None


def _shutdown(launcher: Launcher, code: int, *, wait_s: float = 10.0) -> None:
    """Tell the other nodes the job is over, and keep the store up until they heard (or ``wait_s``)."""
    assert launcher.coordinator is not None
    launcher.coordinator.close(f"the job ended (exit status {code}) before this request was done")
    keys.put(launcher.store, keys.SHUTDOWN, {"code": code})
    deadline = time.monotonic() + wait_s
    while launcher.store.add(keys.SHUTDOWN + "/acks", 0) < launcher.cfg.nnodes - 1 and time.monotonic() < deadline:
        time.sleep(TICK_S)


def _reap(launcher: Launcher) -> None:
    for pid, child in list(launcher.children.items()):
        code = child.proc.poll()
        if code is None:
            continue
        del launcher.children[pid]
        if child.log is not None:
            child.log.close()
        what = f"rank {child.rank}" if child.kind == "rank" else f"spare {child.spare}"
        log.info("%s (pid %d) exited with %d", what, pid, code)
        node = launcher.cfg.node_rank
        if launcher.coordinator is not None:
            launcher.coordinator.exited(node=node, pid=pid, code=code)
        else:
            keys.append(launcher.store, keys.EV_SEQ, keys.event, {"kind": "exit", "node": node, "pid": pid,
                                                                  "code": code})


def _replenish(launcher: Launcher) -> None:
    cfg = launcher.cfg
    spares = [c for c in launcher.children.values() if c.kind == "spare"]
    for child in spares:
        if launcher.store.check([keys.assign(child.spare)]):
            child.kind = "taken"  # a rank now; its exit is reported like any rank's
    waiting = sum(1 for c in launcher.children.values() if c.kind == "spare")
    while waiting < cfg.spares and launcher._spare_starts < 5 * cfg.spares:
        launcher._spawn_spare()
        waiting += 1


def _lead(launcher: Launcher, started: float) -> int | None:
    c = launcher.coordinator
    assert c is not None
    _events(launcher)
    _requests(launcher)
    _heartbeats(launcher, started)
    c.tick()
    if launcher._periodic is not None:
        launcher._periodic.tick(c)
    if c.failed:
        log.error("job %s failed: %s", launcher.cfg.job_id, c.failed)
        return 1
    if len(c.slots) == launcher.cfg.world_size and all(s.done for s in c.slots.values()):
        if c.failed_at_end:
            log.error("job %s trained to its end, but %s", launcher.cfg.job_id, "; ".join(c.failed_at_end))
            return 1
        log.info("job %s completed (generation %d)", launcher.cfg.job_id, c.generation)
        return 0
    return None


def _events(launcher: Launcher) -> None:
    c, store = launcher.coordinator, launcher.store
    assert c is not None
    while store.check([keys.event(launcher._ev_cursor)]):
        doc = keys.get(store, keys.event(launcher._ev_cursor))
        launcher._ev_cursor += 1
        if doc["kind"] == "placed":
            c.placed(int(doc["rank"]), node=int(doc["node"]), pid=int(doc["pid"]))
        elif doc["kind"] == "exit":
            c.exited(node=int(doc["node"]), pid=int(doc["pid"]), code=int(doc["code"]))


def _requests(launcher: Launcher) -> None:
    c, store = launcher.coordinator, launcher.store
    assert c is not None
    while store.check([keys.request(launcher._req_cursor)]):
        n = launcher._req_cursor
        launcher._req_cursor += 1
        doc = keys.get(store, keys.request(n))

        def reply(result: dict[str, Any], n: int = n) -> None:
            keys.put(store, keys.request(n, "reply"), result)

        if doc["cmd"] == "status":
            reply({"ok": True, "job": launcher.cfg.job_id, "nproc_per_node": launcher.cfg.nproc_per_node,
                   "spares_per_node": launcher.cfg.spares,
                   **c.status()})
        elif doc["cmd"] == "migrate":
            accepted = c.migrate([int(r) for r in doc["ranks"]], reason=str(doc.get("reason", "")), reply=reply)
            if not accepted["ok"]:
                reply(accepted)
        elif doc["cmd"] == "snapshot":
            from ridethrough.actuators.snapshot import SnapshotOp

            c.submit(SnapshotOp(launcher.cfg.snapshot_dir, launcher.cfg.job_id, reply=reply))


def _heartbeats(launcher: Launcher, started: float) -> None:
    c = launcher.coordinator
    assert c is not None
    now = time.monotonic()
    grace = max(c.timeouts.form_s, c.timeouts.heartbeat_s)
    for node in range(1, launcher.cfg.nnodes):
        value = keys.peek(launcher.store, keys.heartbeat(node))
        seen, since = launcher._beats.get(node, (None, started + grace))
        if value != seen:
            launcher._beats[node] = (value, now)
        elif since != float("inf") and now - since > c.timeouts.heartbeat_s:
            launcher._beats[node] = (value, float("inf"))  # lost once
            c.node_lost(node)


def _follow(launcher: Launcher) -> int | None:
    store = launcher.store
    keys.put(store, keys.heartbeat(launcher.cfg.node_rank), time.time())
    restart = keys.peek(store, keys.RESTART)
    if restart is not None and int(restart["life"]) > launcher._life:
        log.warning("restarting this node's ranks from snapshot %s", restart["snapshot"])
        launcher.restart_local(int(restart["life"]), int(restart["gen"]), str(restart["snapshot"]))
    shutdown = keys.peek(store, keys.SHUTDOWN)
    if shutdown is not None:
        return int(shutdown["code"])
    return None
