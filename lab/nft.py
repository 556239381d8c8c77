"""Random packet loss on a lab interface with nftables: a failing optic or a dirty fibre.

A bad optic or fibre shows up as CRC errors at the receiver, i.e. a share of the frames sent
on one cable that never arrive, independent of load. The kernel here has no ``netem``, so
the lab drops in nftables instead, in the sending node's namespace: one table per namespace
(``inet ridethrough``) with one base chain on ``postrouting`` (it sees forwarded packets on a
switch and locally sent ones on a host), and one rule per lossy interface::

    oifname "eth3" numgen random mod 10000 < 500 counter drop comment "loss:eth3"

Rules are keyed by interface (their comment), so two links of one switch can be lossy at once
and setting an interface again replaces its rule. Clearing the last rule deletes the table,
so a restored lab holds nothing of ours; a removed namespace takes its table with it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from typing import Any

from ridethrough.lab.control import LabError
from ridethrough.lab.netns import enter_fn

TABLE = "ridethrough"
"""The table, in family ``inet``, that holds every lab rule of a namespace."""
CHAIN = "loss"
SCALE = 10_000
"""``numgen random mod SCALE``: loss is set in steps of 0.01 %."""
NFT_TIMEOUT_S = 30.0
"""A busy 2-core machine can take seconds to schedule nft; it never legitimately takes this long."""
_SBIN = ("/usr/sbin", "/sbin")


def check_percent(percent: object) -> float:
    """``percent`` as a float in (0, 100]; LabError (one line) otherwise."""
    if isinstance(percent, bool) or not isinstance(percent, int | float) or not math.isfinite(percent):
        raise LabError(f"loss percent must be a number in (0, 100], got {percent!r}")
    if not 0 < percent <= 100:
        raise LabError(f"loss percent must be in (0, 100], got {percent:g}")
    if round(percent * SCALE / 100) < 1:
        raise LabError(f"loss percent {percent:g} is below the smallest step ({100 / SCALE:g} %)")
    return float(percent)


def which(name: str) -> str | None:
    """An executable on PATH or in the sbin directories (a non-root PATH often lacks them); None if there is none."""
    path = os.environ.get("PATH", "")
    return shutil.which(name, path=os.pathsep.join([path, *_SBIN]) if path else os.pathsep.join(_SBIN))


def nft_binary() -> str:
    """The ``nft`` executable; LabError saying what to install when there is none."""
    found = which("nft")
    if found is None:
        raise LabError("packet loss needs nftables, and `nft` is not installed: install the nftables Debian "
                       "package (apt-get install nftables)")
    return found


def available() -> bool:
    """Whether ``nft`` is installed."""
    try:
        nft_binary()
    except LabError:
        return False
    return True


def _nft(ns: str | None, args: list[str], *, script: str | None = None) -> str:
    """Run ``nft ARGS`` in namespace ``ns`` (None: this one); its stdout, or LabError with nft's message."""
    argv = [nft_binary(), *args]
    try:
        done = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=NFT_TIMEOUT_S,
                              preexec_fn=enter_fn(ns, None))  # preexec_fn: enters the namespace before exec
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"nft in {ns or '(root)'}: no answer after {NFT_TIMEOUT_S:g} s") from exc
    except OSError as exc:
        raise LabError(f"nft in {ns or '(root)'}: {exc}") from exc
    if done.returncode != 0:
        why = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
        raise LabError(f"nft in {ns or '(root)'}: {why}")
    return done.stdout


def _comment(ifname: str) -> str:
    return f"loss:{ifname}"


def _rules(ns: str | None) -> list[dict[str, Any]] | None:
    """The rules of our chain (each nft's JSON ``rule`` object), or None when the table is absent."""
    tables = json.loads(_nft(ns, ["-j", "list", "tables"]) or "{}").get("nftables", [])
    if not any(t.get("table", {}).get("name") == TABLE and t["table"].get("family") == "inet" for t in tables):
        return None
    listed = json.loads(_nft(ns, ["-j", "list", "table", "inet", TABLE]) or "{}").get("nftables", [])
    return [item["rule"] for item in listed if "rule" in item and item["rule"].get("chain") == CHAIN]


def _deletes(rules: list[dict[str, Any]], ifname: str) -> list[str]:
    return [f"delete rule inet {TABLE} {CHAIN} handle {r['handle']}"
            for r in rules if r.get("comment") == _comment(ifname)]


def set_loss(ns: str | None, ifname: str, percent: float) -> None:
    """Drop ``percent`` % of the packets leaving ``ifname`` in ``ns`` (replacing any loss it had).

    One nft transaction: table, chain, the old rule's removal and the new rule apply together or not at all.
    """
    percent = check_percent(percent)
    if not ifname or '"' in ifname or "\n" in ifname:
        raise LabError(f"bad interface name {ifname!r}")
    existing = _rules(ns) or []
    lines = [f"add table inet {TABLE}",
             f"add chain inet {TABLE} {CHAIN} {{ type filter hook postrouting priority 0; policy accept; }}",
             *_deletes(existing, ifname),
             f'add rule inet {TABLE} {CHAIN} oifname "{ifname}" numgen random mod {SCALE} '
             f'< {round(percent * SCALE / 100)} counter drop comment "{_comment(ifname)}"']
    _nft(ns, ["-f", "-"], script="\n".join(lines) + "\n")


def clear_loss(ns: str | None, ifname: str) -> None:
    """Stop dropping on ``ifname`` in ``ns``; the table goes with its last rule. Nothing to clear is fine."""
    rules = _rules(ns)
    if rules is None:
        return
    drop = _deletes(rules, ifname)
    if len(drop) == len(rules):
        _nft(ns, ["delete", "table", "inet", TABLE])
    elif drop:
        _nft(ns, ["-f", "-"], script="\n".join(drop) + "\n")


def losses(ns: str | None) -> dict[str, dict[str, float]]:
    """Per lossy interface in ``ns``: ``percent`` set and ``dropped`` (packets dropped so far)."""
    out: dict[str, dict[str, float]] = {}
    for rule in _rules(ns) or []:
        comment = str(rule.get("comment", ""))
        if not comment.startswith("loss:"):
            continue
        entry = {"percent": 0.0, "dropped": 0.0}
        for expr in rule.get("expr", []):
            if "counter" in expr:
                entry["dropped"] = float(expr["counter"].get("packets", 0))
            match = expr.get("match", {})
            if match.get("op") == "<" and isinstance(match.get("right"), int):
                entry["percent"] = match["right"] * 100 / SCALE
        out[comment.removeprefix("loss:")] = entry
    return out


def has_table(ns: str | None) -> bool:
    """Whether the lab's nft table exists in ``ns``."""
    return _rules(ns) is not None
