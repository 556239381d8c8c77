"""Data loader positions: what each ``DataLoader`` yielded, and moving one to a recorded position.

The shim wraps ``DataLoader.__iter__``. Loaders are known by the order of their first iteration
(the same order in every run of the same script). A loader's position is its epoch (how many
times it was iterated, less one), the batches yielded by the current iterator, and the CPU
random state when that iterator was made (a ``RandomSampler`` without its own generator draws
its permutation from it).

`LoaderTracker.seek` moves loaders to recorded positions, for a process that takes over a rank
or resumes from a snapshot. Its script starts from the top, so its loop asks for epoch 0 first:
epochs before the target come back empty (the script's epoch loop runs through them), the target
epoch's iterator is made under the recorded random state and skips the batches already used (by
drawing sampler indices, without loading data, when the loader runs in-process; by loading and
dropping them otherwise).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset

_NO_RNG = torch.empty(0, dtype=torch.uint8)


@dataclass(slots=True)
class Position:
    """Where a loader is: ``epoch`` (-1 before its first iteration), ``index`` batches into it, ``rng`` at its start."""

    epoch: int = -1
    index: int = 0
    rng: torch.Tensor = field(default_factory=lambda: _NO_RNG)

    def state(self) -> dict[str, Any]:
        """As a state dict entry."""
        return {"epoch": self.epoch, "index": self.index, "rng": self.rng.clone()}

    @classmethod
    def from_state(cls, doc: Any) -> Position:
        """From `state`'s output; ValueError for anything else."""
        try:
            pos = cls(int(doc["epoch"]), int(doc["index"]), doc["rng"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a data loader position: {str(doc)[:120]}") from exc
        if not isinstance(pos.rng, torch.Tensor) or pos.index < 0:
            raise ValueError(f"not a data loader position: {str(doc)[:120]}")
        return pos


@dataclass(slots=True)
class _Loader:
    order: int
    ref: weakref.ref[Any]
    at: Position = field(default_factory=Position)
    target: Position | None = None


class LoaderTracker:
    """Wraps ``DataLoader.__iter__`` (`install`): ``on_next`` runs before each batch, ``on_fetch`` before its fetch.

    ``on_next`` may `seek` (a replacement learns its target at its first batch); ``on_fetch`` runs
    once the loader is where it should be.
    """

    def __init__(self, *, on_next: Callable[[], None], on_fetch: Callable[[], None]) -> None:
        self._on_next = on_next
        self._on_fetch = on_fetch
        self._loaders: list[_Loader] = []
        self._by_id: dict[int, _Loader] = {}
        self._seek: list[Position] | None = None
        self._original: Callable[[Any], Iterator[Any]] | None = None

    def install(self, loader_class: type[Any]) -> Callable[[], None]:
        """Wrap ``loader_class.__iter__``; returns what puts the original back."""
        original = loader_class.__iter__
        self._original = original
        tracker = self

        def __iter__(loader: Any) -> Iterator[Any]:
            return tracker._iterate(loader)

        __iter__.__doc__ = original.__doc__
        loader_class.__iter__ = __iter__

        def restore() -> None:
            loader_class.__iter__ = original
        return restore

    def positions(self) -> list[Position]:
        """Every loader's position, in loader order."""
        return [Position(entry.at.epoch, entry.at.index, entry.at.rng) for entry in self._loaders]

    def seek(self, positions: list[Position]) -> None:
        """Move loaders to ``positions`` (loader order), now or as the script gets to them."""
        self._seek = list(positions)
        for entry in self._loaders:
            entry.target = self._seek[entry.order] if entry.order < len(self._seek) else None

    @property
    def seeking(self) -> bool:
        """True while a loader that was iterated is not yet at its target."""
        return any(entry.target is not None for entry in self._loaders)

    def _entry(self, loader: Any) -> _Loader:
        entry = self._by_id.get(id(loader))
        if entry is None or entry.ref() is not loader:
            entry = _Loader(len(self._loaders), weakref.ref(loader))
            if self._seek is not None and entry.order < len(self._seek):
                entry.target = self._seek[entry.order]
            self._loaders.append(entry)
            self._by_id[id(loader)] = entry
        return entry

    def _iterate(self, loader: Any) -> Iterator[Any]:
        entry = self._entry(loader)
        entry.at = Position(entry.at.epoch + 1, 0, torch.get_rng_state())
        target = entry.target
        if target is not None and entry.at.epoch < target.epoch:
            return iter(())  # an epoch the taken-over rank had finished: the script's loop runs through it
        return _Tracked(self, loader, entry, self._make(loader, entry))

    def _make(self, loader: Any, entry: _Loader) -> Iterator[Any]:
        """The real iterator for the loader's current epoch, moved to its target if it has one there."""
        assert self._original is not None
        target = entry.target
        if target is None or target.epoch != entry.at.epoch:
            return self._original(loader)
        if target.rng.numel():
            torch.set_rng_state(target.rng)
        it = self._original(loader)
        _skip(it, target.index, iterable=isinstance(getattr(loader, "dataset", None), IterableDataset))
        entry.at = Position(target.epoch, target.index, target.rng)
        entry.target = None
        return it


class _Tracked:
    """A loader's iterator that counts batches and lets the shim act before each fetch."""

    def __init__(self, tracker: LoaderTracker, loader: Any, entry: _Loader, it: Iterator[Any]) -> None:
        self._tracker, self._loader, self._entry, self._it = tracker, loader, entry, it

    def __iter__(self) -> _Tracked:
        return self

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]  # as the wrapped iterator (a TypeError if it has none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)

    def __next__(self) -> Any:
        tracker, entry = self._tracker, self._entry
        tracker._on_next()
        target = entry.target
        if target is not None:  # learnt while this iterator was open: a replacement at its first batch
            if target.epoch > entry.at.epoch:
                raise StopIteration  # end this epoch now; the next iterations run to the target
            if target.epoch < entry.at.epoch or (target.epoch == entry.at.epoch and target.index < entry.at.index):
                raise RuntimeError(f"ridethrough: data loader {entry.order} is at epoch {entry.at.epoch} batch "
                                   f"{entry.at.index} and cannot go back to epoch {target.epoch} batch {target.index}")
            self._it = tracker._make(self._loader, entry)
        tracker._on_fetch()
        batch = next(self._it)
        entry.at.index += 1
        return batch


def _skip(it: Iterator[Any], n: int, *, iterable: bool) -> None:
    """Move ``it`` past ``n`` batches: by sampler indices when it loads in-process, else by loading them."""
    next_index = getattr(it, "_next_index", None)
    # An in-process iterator over a map-style dataset fetches exactly the indices it draws; a
    # multi-process one has already sent indices to its workers, and an iterable dataset has no
    # indices, so only reading batches moves those.
    in_process = callable(next_index) and getattr(it, "_num_workers", 0) == 0 and not iterable
    for _ in range(n):
        if in_process:
            next_index()  # type: ignore[misc]  # checked callable above
        else:
            next(it)
