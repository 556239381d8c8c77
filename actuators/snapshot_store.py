"""Whole-job snapshots on disk: every rank writes its part, one committer makes the set count.

Layout under ``root`` (shared by all ranks; a shared filesystem when ranks span hosts)::

    .partial-step-000000000120/rank-00000.ckpt ...   ranks writing (ridethrough.checkpoint files)
    step-000000000100/rank-00000.ckpt ... manifest.json    committed

`SnapshotStore.write_rank` saves one rank's state in the background (`ridethrough.checkpoint`:
staged copy, temp file, fsync, rename). `SnapshotStore.commit` runs once all ranks' writes are done:
it checks every rank file is there, writes ``manifest.json`` (world size, model shapes, step, each
rank file's size and digest, a sha256 over the rest) through a temp file and fsync, then renames the
partial directory to ``step-N`` and fsyncs the root. Only directories named ``step-N`` that hold a
sound manifest count, so a job killed at any point (mid-write, before or during commit) leaves the
last committed snapshot as the one `latest` returns. Older snapshots beyond ``keep`` are pruned.

A rank file's digest (`ridethrough.checkpoint.digest`) hashes its index, which holds a crc32 of every
tensor: commit reads a few KiB per rank, not the snapshot, and a load still checks every byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ridethrough import checkpoint
from ridethrough.checkpoint import CheckpointCorrupt, Checkpointer, SaveHandle

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_COMMITTED = re.compile(r"^step-(\d{12})$")
_PARTIAL = re.compile(r"^\.partial-step-(\d{12})$")
_RANK = re.compile(r"^rank-(\d+)\.ckpt$")


class SnapshotIncompatible(ValueError):
    """A snapshot cannot resume this job (another world size or model shape); the message says what differs."""


class SnapshotIncomplete(ValueError):
    """A commit was refused: rank files are missing or extra; nothing was committed."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor's shape and dtype name (``"float32"``)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotMeta:
    """What `SnapshotStore.commit` records beside the rank files."""

    world_size: int
    shapes: Mapping[str, TensorSpec]
    """The model's tensors by name (`shapes_of`): what a resuming job must match."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything JSON the job wants back on resume (job id, data loader position, ...)."""


@dataclass(frozen=True, slots=True)
class RankFile:
    """One rank's file in a committed snapshot: its name, size and `ridethrough.checkpoint.digest`."""

    file: str
    bytes: int
    digest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """A committed snapshot, as its manifest describes it."""

    step: int
    path: Path
    world_size: int
    shapes: Mapping[str, TensorSpec]
    ranks: tuple[RankFile, ...]
    extra: Mapping[str, Any]
    committed_unix_s: float


def shapes_of(state_dict: Mapping[str, Any], prefix: str = "") -> dict[str, TensorSpec]:
    """Every tensor of a (nested) state dict by dotted name, e.g. ``{"fc.weight": TensorSpec((4, 8), "float32")}``."""
    import torch

    out: dict[str, TensorSpec] = {}
    for key, value in state_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = TensorSpec(tuple(value.shape), checkpoint.dtype_name(value.dtype))
        elif isinstance(value, Mapping):
            out.update(shapes_of(value, f"{name}."))
    return out


def check_compatible(snapshot: Snapshot, world_size: int, shapes: Mapping[str, Any]) -> None:
    """Raise `SnapshotIncompatible` unless this job (``world_size`` ranks, model ``shapes``) can resume it.

    ``shapes``: `TensorSpec` by name (`shapes_of`), or the model's state dict itself.
    """
    if not all(isinstance(v, TensorSpec) for v in shapes.values()):
        shapes = shapes_of(shapes)
    where = f"snapshot of step {snapshot.step} ({snapshot.path})"
    if world_size != snapshot.world_size:
        raise SnapshotIncompatible(
            f"{where} was written by {snapshot.world_size} ranks, this job has {world_size}: refusing to resume "
            f"(start with {snapshot.world_size} ranks, or reshard the snapshot first)")
    problems = [f"{name}: snapshot {_spec(snapshot.shapes.get(name))}, job {_spec(shapes.get(name))}"
                for name in sorted(set(snapshot.shapes) | set(shapes))
                if snapshot.shapes.get(name) != shapes.get(name)]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise SnapshotIncompatible(f"{where} holds a different model: {'; '.join(problems[:5])}{more}")


def _spec(spec: TensorSpec | None) -> str:
    return "missing" if spec is None else f"{list(spec.shape)} {spec.dtype}"


class SnapshotStore:
    """Snapshots of a whole job under ``root``; keeps the newest ``keep`` committed ones."""

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 3,
                 checkpointer: Checkpointer | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.root = Path(root)
        self.keep = keep
        self._checkpointer = checkpointer

    def write_rank(self, step: int, rank: int, state_dict: object) -> SaveHandle:
        """Start saving ``rank``'s state for ``step`` in the background; commit once every rank's handle is done."""
        if step < 0 or rank < 0:
            raise ValueError(f"step and rank must be non-negative (step {step}, rank {rank})")
        if (self.root / _committed(step)).exists():
            raise FileExistsError(f"snapshot of step {step} is already committed in {self.root}")
        partial = self.root / _partial(step)
        partial.mkdir(parents=True, exist_ok=True)
        return checkpoint.save_async(state_dict, partial / _rank_file(rank), checkpointer=self._checkpointer)

    def commit(self, step: int, meta: SnapshotMeta) -> Snapshot:
        """Make ``step`` count: check its rank files, write the manifest last, rename into place, prune."""
        partial, final = self.root / _partial(step), self.root / _committed(step)
        if final.exists():
            raise FileExistsError(f"snapshot of step {step} is already committed in {self.root}")
        names = [p.name for p in partial.iterdir()] if partial.is_dir() else []
        found = {int(m[1]) for name in names if (m := _RANK.match(name))}
        missing, extra = sorted(set(range(meta.world_size)) - found), sorted(found - set(range(meta.world_size)))
        if missing or extra or meta.world_size < 1:
            raise SnapshotIncomplete(f"step {step} in {self.root} not committed: world size {meta.world_size}, "
                                     f"rank files missing for {missing}, unexpected for {extra}")
        for name in names:
            if name.startswith(".") and ".tmp-" in name:  # left by a writer that was killed; never a rank file
                (partial / name).unlink(missing_ok=True)
        ranks = [RankFile(_rank_file(r), (partial / _rank_file(r)).stat().st_size,
                          checkpoint.digest(partial / _rank_file(r))) for r in range(meta.world_size)]
        body = {"format": "ridethrough.snapshot", "version": 1, "step": step, "world_size": meta.world_size,
                "committed_unix_s": time.time(), "extra": dict(meta.extra),
                "shapes": {k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in sorted(meta.shapes.items())},
                "ranks": [{"file": r.file, "bytes": r.bytes, "digest": r.digest} for r in ranks]}
        _write_json_atomically(partial / MANIFEST, {**body, "sha256": _sha256(body)})
        os.rename(partial, final)  # refuses to replace a non-empty directory: a commit never overwrites one
        checkpoint.fsync_dir(self.root)
        try:
            self.prune()
        except OSError as exc:  # the commit stands; old snapshots wait for the next prune
            log.warning("snapshot of step %d committed, but pruning %s failed: %s", step, self.root, exc)
        return _parse(final, {**body, "sha256": _sha256(body)})

    def snapshots(self) -> list[Snapshot]:
        """Committed snapshots with a sound manifest, oldest first (a damaged one is logged and skipped)."""
        out = []
        names = sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []
        for path in (self.root / name for name in names if _COMMITTED.match(name)):
            try:
                out.append(_parse(path, json.loads((path / MANIFEST).read_text())))
            except (OSError, ValueError) as exc:
                log.warning("skipping snapshot %s: %s", path, exc)
        return out

    def latest(self) -> Snapshot | None:
        """The newest committed snapshot, or None."""
        found = self.snapshots()
        return found[-1] if found else None

    def load_rank(self, snapshot: Snapshot, rank: int, *, map_location: str = "cpu") -> Any:
        """``rank``'s state; `CheckpointCorrupt` if its file is not the one committed or fails a checksum."""
        if not 0 <= rank < snapshot.world_size:
            raise ValueError(f"rank {rank} is outside the snapshot's world size {snapshot.world_size}")
        entry = snapshot.ranks[rank]
        path = snapshot.path / entry.file
        if checkpoint.digest(path) != entry.digest:
            raise CheckpointCorrupt(f"{path}: not the file committed in {snapshot.path / MANIFEST} (digest differs)")
        return checkpoint.load(path, map_location=map_location)

    check_compatible = staticmethod(check_compatible)

    def prune(self) -> list[int]:
        """Remove committed snapshots beyond the newest ``keep`` and abandoned partial ones; the steps removed."""
        steps = sorted(int(m[1]) for p in self.root.iterdir() if (m := _COMMITTED.match(p.name)))
        doomed = [self.root / _committed(s) for s in steps[:-self.keep]]
        newest = steps[-1] if steps else -1
        # A partial step at or below the newest commit can no longer be committed in order: abandoned.
        doomed += [p for p in self.root.iterdir() if (m := _PARTIAL.match(p.name)) and int(m[1]) <= newest]
        for path in doomed:
            trash = self.root / f".trash-{path.name.lstrip('.')}-{secrets.token_hex(4)}"
            os.rename(path, trash)  # out of sight first: a half-deleted snapshot must never look committed
            shutil.rmtree(trash, ignore_errors=True)
        for leftover in self.root.glob(".trash-*"):  # from a prune that was itself cut short
            shutil.rmtree(leftover, ignore_errors=True)
        return steps[:-self.keep]


def _committed(step: int) -> str:
    return f"step-{step:012d}"


def _partial(step: int) -> str:
    return f".partial-step-{step:012d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.ckpt"


def _sha256(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_json_atomically(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    checkpoint.fsync_dir(path.parent)


def _parse(path: Path, doc: Any) -> Snapshot:
    """A `Snapshot` from its manifest; ValueError for anything that does not check out."""
    if not isinstance(doc, dict) or doc.get("format") != "ridethrough.snapshot" or doc.get("version") != 1:
        raise ValueError(f"{path / MANIFEST}: not a ridethrough snapshot manifest")
    body = {k: v for k, v in doc.items() if k != "sha256"}
    if doc.get("sha256") != _sha256(body):
        raise CheckpointCorrupt(f"{path / MANIFEST}: manifest fails its checksum")
    try:
        ranks = tuple(RankFile(str(r["file"]), int(r["bytes"]), str(r["digest"])) for r in doc["ranks"])
        shapes = {str(k): TensorSpec(tuple(int(d) for d in v["shape"]), str(v["dtype"]))
                  for k, v in doc["shapes"].items()}
        snap = Snapshot(step=int(doc["step"]), path=path, world_size=int(doc["world_size"]), shapes=shapes,
                        ranks=ranks, extra=dict(doc["extra"]), committed_unix_s=float(doc["committed_unix_s"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path / MANIFEST}: malformed manifest ({exc!r})") from exc
    if len(ranks) != snap.world_size or _committed(snap.step) != path.name:
        raise ValueError(f"{path / MANIFEST}: {len(ranks)} rank files for world size {snap.world_size}, step "
                         f"{snap.step} in directory {path.name}")
    return snap
