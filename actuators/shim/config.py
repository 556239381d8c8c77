"""The environment contract between the launcher and the shim in each rank, parsed in one place.

torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ...) are set for every rank as torchrun sets them, so a script
runs unchanged with or without the shim. The shim's own settings travel as ``RIDETHROUGH_*``:
`ShimConfig.env` writes them, `ShimConfig.from_env` reads them back and says exactly what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

ENABLE = "RIDETHROUGH_SHIM"
"""Set to ``1`` by the launcher: the shim boots in this process (and removes its variables, so
the script's own subprocesses, e.g. data loader workers, do not boot it again)."""
_PREFIX = "RIDETHROUGH_SHIM_"


@dataclass(frozen=True, slots=True, kw_only=True)
class ShimConfig:
    """What one rank (or hot spare) process needs to know beyond torchrun's variables."""

    job: str
    customer: str = "default"
    role: str = "rank"
    """``rank`` (a member from the start) or ``spare`` (parked until the coordinator assigns a rank)."""
    spare_id: str = ""
    node: int = 0
    nproc_per_node: int = 1
    world_size: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0
    generation: int = 0
    resume: str = ""
    """A committed snapshot directory every rank resumes from ('' to start fresh)."""
    snapshot_dir: str = ""
    """Where ``ridethrough snapshot`` writes ('' refuses snapshots)."""
    snapshot_every: int = 0
    """Every rank saves a snapshot at each step divisible by this (0: only when asked)."""
    life: int = 0
    """How many times the job was restarted from a snapshot (keys of periodic snapshots carry it)."""
    job_socket: str = ""
    """The node agent's job socket for step events ('' reports nothing)."""
    collective_timeout_s: float = 300.0
    """A collective stalled this long counts as failed (a peer's host frozen and nobody said so)."""
    rendezvous_timeout_s: float = 60.0
    """Longest wait to form a process group, or for a command's other ranks."""
    recovery_timeout_s: float = 120.0
    """Longest wait for the coordinator's plan after a failed collective."""

    def __post_init__(self) -> None:
        if self.role not in ("rank", "spare"):
            raise ValueError(f"role must be 'rank' or 'spare', got {self.role!r}")
        if self.role == "spare" and not self.spare_id:
            raise ValueError("a spare needs a spare_id")
        if not self.job:
            raise ValueError("job must not be empty")
        for name in ("nproc_per_node", "world_size", "store_port"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("collective_timeout_s", "rendezvous_timeout_s", "recovery_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def env(self) -> dict[str, str]:
        """The variables that carry this config (plus `ENABLE`)."""
        out = {ENABLE: "1"}
        for f in fields(self):
            out[_PREFIX + f.name.upper()] = str(getattr(self, f.name))
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ShimConfig:
        """The config the launcher wrote; ValueError naming the variable that is missing or malformed."""
        values: dict[str, object] = {}
        for f in fields(cls):
            name = _PREFIX + f.name.upper()
            if name not in environ:
                continue
            raw = environ[name]
            kind = type(getattr(_DEFAULTS, f.name)) if hasattr(_DEFAULTS, f.name) else str
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a {kind.__name__}") from None
        if "job" not in values:
            raise ValueError(f"{_PREFIX}JOB is not set: the shim runs only under `ridethrough run`")
        return cls(**values)  # type: ignore[arg-type]  # each value was converted to its field's type above

    def variables(self) -> tuple[str, ...]:
        """Every variable name of the contract (to remove them from the environment once read)."""
        return (ENABLE, *(_PREFIX + f.name.upper() for f in fields(self)))


_DEFAULTS = ShimConfig(job="-", store_port=1)


def torchrun_env(*, rank: int, local_rank: int, nproc_per_node: int, node: int, nnodes: int, world_size: int,
                 master_addr: str, master_port: int, run_id: str, restarts: int = 0) -> dict[str, str]:
    """The variables torchrun gives each worker, for the same worker here."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(nproc_per_node), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nnodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_MAX_RESTARTS": "0",
            # the launcher hosts the store, as torchrun's agent does: env:// rendezvous joins it as a client
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
