"""A lab's record of what it made, written as it makes it, so ``lab down`` can undo a crash.

One JSON file per lab, ``{state_root}/{name}.json``, next to the lab's directory
``{state_root}/{name}/`` (host trees, store, logs). Several processes write it (the process
that brought the lab up, its supervisor, ``lab inject``): every change is a locked
read-modify-write that replaces the file atomically, so a reader never sees half of one.

Keys (all optional but ``name``, ``mode``, ``dir``)::

    {"name": "demo", "mode": "netns" | "loopback", "prefix": "rk3fa", "dir": "...",
     "spec": {"hosts": 8, ...}, "mgmt_subnet": "198.18.7.0/24", "agents": true,
     "namespaces": [...], "root_links": [...], "cgroups": [...],   # recorded before creation
     "processes": {"supervisor": {"pid": 1, "start": 2}, "agent:h0": {...}, "load:1": [...]},
     "status": {"fabric": "ready", "supervisor": "running", "server": {...}},
     "faults": {"link:h0-leaf0r0": "degrade 10 mbit", ...}, "frozen": {"h3": [pids]},
     "schedule": [{"id": 1, "at_ns": ..., "op": "set_link", "args": {...}}], "next_id": 2}
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ridethrough.lab.control import LabError
from ridethrough.lab.topology import check_lab_name

DEFAULT_STATE_ROOT = Path("/run/ridethrough/labs")
STATE_ROOT_ENV = "RIDETHROUGH_LAB_STATE_ROOT"
State = dict[str, Any]
T = TypeVar("T")


def default_state_root(env: Mapping[str, str]) -> Path:
    """Where labs keep their state: ``$RIDETHROUGH_LAB_STATE_ROOT``, else ``/run/ridethrough/labs`` for
    root and ``$XDG_RUNTIME_DIR/ridethrough/labs`` (or a per-user temporary folder) for anyone else.
    """
    if env.get(STATE_ROOT_ENV):
        return Path(env[STATE_ROOT_ENV])
    if os.geteuid() == 0:
        return DEFAULT_STATE_ROOT
    base = env.get("XDG_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(), f"ridethrough-{os.geteuid()}")
    return Path(base) / "ridethrough" / "labs"


def list_labs(root: Path) -> list[str]:
    """Names of the labs with a state file under ``root``."""
    if not root.is_dir():
        return []
    return sorted(p.stem for p in root.glob("*.json") if not p.name.startswith("."))


@contextlib.contextmanager
def root_lock(root: Path) -> Iterator[None]:
    """Serialise choices that must not collide across labs (prefixes, management subnets)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".alloc.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class StateFile:
    """One lab's state file: create, read, update under a lock, remove."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = Path(root)
        self.name = name
        self.path = self.root / f"{name}.json"
        self.lock_path = self.root / f".{name}.lock"
        self.dir = self.root / name

    def exists(self) -> bool:
        """Whether the lab has a state file."""
        return self.path.exists()

    def create(self, initial: State) -> None:
        """Write the first state; LabError if the lab already exists."""
        with self._locked():
            if self.path.exists():
                raise LabError(f"lab {self.name!r} already exists (state {self.path}); "
                               f"take it down first: ridethrough lab down {self.name}")
            self._write(initial)

    def read(self) -> State:
        """The current state; LabError if there is no such lab or the file is unreadable."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise LabError(f"no lab {self.name!r} under {self.root}") from None
        except (OSError, ValueError) as exc:
            raise LabError(f"lab {self.name!r}: unreadable state {self.path}: {exc}") from exc
        if not isinstance(data, dict):
            raise LabError(f"lab {self.name!r}: malformed state {self.path}")
        return data

    def update(self, change: Callable[[State], T]) -> T:
        """Apply ``change`` to the state in place and write it back, under the lab's lock."""
        with self._locked():
            state = self.read()
            result = change(state)
            self._write(state)
            return result

    def append(self, key: str, *values: Any) -> None:
        """Add values to a list in the state (before creating what they name)."""
        def add(state: State) -> None:
            state.setdefault(key, []).extend(values)
        self.update(add)

    def set_in(self, key: str, sub: str, value: Any) -> None:
        """``state[key][sub] = value``."""
        def put(state: State) -> None:
            state.setdefault(key, {})[sub] = value
        self.update(put)

    def remove(self) -> None:
        """Delete the state file and its lock (the lab is gone)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(FileNotFoundError):
            self.lock_path.unlink()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _write(self, state: State) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{self.name}-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def read_running(name: str, *, state_root: Path | None, mode: str) -> tuple[StateFile, State]:
    """The state file and state of running lab ``name``; `LabError` if it runs in another mode."""
    sf = StateFile(state_root or default_state_root(os.environ), check_lab_name(name))
    state = sf.read()
    if state.get("mode") != mode:
        raise LabError(f"lab {name} runs in {state.get('mode')} mode, not {mode}")
    return sf, state
