"""A rank's whole training state as one tree, and moving it to another process.

`capture` gathers what the tracker found: every model's and optimizer's and scheduler's state
dict, and the step's small state (random generators and data loader positions, recorded before
the step used them). `apply` puts such a tree back into freshly built objects; a tree that does
not fit the script (another number of models or optimizers, other shapes) is a `StateMismatch`
naming what differs, raised before anything is changed.

`send` and `receive` move a tree between two processes: its skeleton (JSON, tensors replaced by
their index, dtype and shape) through the job store, every tensor's bytes in one buffer over a
two-member gloo group (with NCCL the same buffer would go device to device). Nothing is unpickled.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ridethrough.actuators.shim import keys
from ridethrough.actuators.shim.discovery import Tracker, unwrap
from ridethrough.actuators.shim.loaders import Position

FORMAT = 1


class StateMismatch(ValueError):
    """A state tree that does not fit this script's objects; the message says what differs."""


def rng_state() -> dict[str, Any]:
    """Every random generator the script may draw from (torch CPU and CUDA, numpy's global, Python's)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # (untyped)
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    np = sys.modules.get("numpy")
    if np is not None:
        name, state, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = {"name": str(name), "keys": torch.from_numpy(state.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(gauss)}
    version, ints, gauss_next = random.getstate()
    out["python"] = {"version": version, "state": torch.tensor(ints, dtype=torch.int64), "gauss": gauss_next}
    return out


def set_rng_state(doc: dict[str, Any]) -> None:
    """Restore what `rng_state` recorded (generators it did not record are left alone)."""
    torch.set_rng_state(doc["torch"])
    if "cuda" in doc and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(doc["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in doc and np is not None:
        n = doc["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
    p = doc["python"]
    random.setstate((p["version"], tuple(int(i) for i in p["state"].tolist()), p["gauss"]))


def capture(tracker: Tracker) -> dict[str, Any]:
    """The rank's state at the current step boundary (live tensors: copy them if training goes on)."""
    if tracker.small is None:
        raise StateMismatch("no step has begun yet: nothing to capture")
    return {"format": FORMAT, "step": tracker.small["step"],
            "models": [unwrap(m).state_dict() for m in tracker.models],
            "optimizers": [o.state_dict() for o in tracker.optimizers],
            "schedulers": [s.state_dict() for s in tracker.schedulers],
            "small": tracker.small}


def check(state: Any, tracker: Tracker) -> None:
    """Raise `StateMismatch` unless ``state`` fits the script's optimizers, schedulers and known models."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise StateMismatch(f"not a ridethrough rank state (format {FORMAT})")
    for name, what, have in (("optimizers", "optimizers", tracker.optimizers),
                             ("schedulers", "LR schedulers", tracker.schedulers)):
        if len(state[name]) != len(have):
            raise StateMismatch(f"the state holds {len(state[name])} {what}, this script built {len(have)}")
    for i, (saved, opt) in enumerate(zip(state["optimizers"], tracker.optimizers, strict=True)):
        theirs = [len(g["params"]) for g in saved.get("param_groups", [])]
        mine = [len(g["params"]) for g in opt.param_groups]
        if theirs != mine:
            raise StateMismatch(f"optimizer {i} ({type(opt).__name__}) has parameter groups of {mine} parameters, "
                                f"the state {theirs}")
    if len(state["models"]) < len(tracker.models):
        raise StateMismatch(f"the state holds {len(state['models'])} models, this script built {len(tracker.models)}")
    for i, model in enumerate(tracker.models):
        check_model(state["models"][i], model, i)


def check_model(saved: dict[str, Any], model: torch.nn.Module, index: int) -> None:
    """Raise `StateMismatch` unless ``saved`` has the names and shapes of ``model``'s state."""
    mine = unwrap(model).state_dict()
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    shapes = [k for k in mine if k in saved and tuple(mine[k].shape) != tuple(saved[k].shape)]
    if missing or extra or shapes:
        raise StateMismatch(f"model {index} differs from the state: missing {missing[:5]}, unexpected {extra[:5]}, "
                            f"other shapes {[(k, list(mine[k].shape), list(saved[k].shape)) for k in shapes[:5]]}")


def apply(state: dict[str, Any], tracker: Tracker) -> None:
    """Load ``state`` (already `check`ed) into the script's objects and generators; models found later load then."""
    for model, saved in zip(tracker.models, state["models"], strict=False):
        unwrap(model).load_state_dict(saved)
    for optimizer, saved in zip(tracker.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(tracker.schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    small = state["small"]
    set_rng_state(small["rng"])
    cycle = small.get("cycle")
    tracker.adopt(step=int(small["step"]), cycle=None if cycle is None else {int(i) for i in cycle})


def positions(state: dict[str, Any]) -> list[Position]:
    """The data loader positions recorded in ``state``."""
    return [Position.from_state(p) for p in state["small"]["loaders"]]


# -- a tree as JSON plus tensors -------------------------------------------------------------

def flatten(obj: Any, tensors: list[torch.Tensor], where: str = "") -> Any:
    """``obj`` as JSON-able data, its tensors appended to ``tensors`` (TypeError names what cannot be)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {"$t": len(tensors) - 1, "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, list | tuple):
        items = [flatten(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"$tuple": items}
    if isinstance(obj, dict):
        return {"$dict": [[flatten(k, tensors, where), flatten(v, tensors, f"{where}.{k}")] for k, v in obj.items()]}
    raise TypeError(f"cannot move {type(obj).__name__} at {where or '<root>'}: only tensors, containers and scalars")


def unflatten(node: Any, tensors: list[torch.Tensor]) -> Any:
    """`flatten`'s data back into a tree."""
    if isinstance(node, list):
        return [unflatten(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if "$t" in node:
        return tensors[node["$t"]]
    if "$tuple" in node:
        return tuple(unflatten(v, tensors) for v in node["$tuple"])
    return {_key(unflatten(k, tensors)): unflatten(v, tensors) for k, v in node["$dict"]}


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _specs(node: Any, out: list[tuple[torch.dtype, list[int]]]) -> None:
    if isinstance(node, list):
        for v in node:
            _specs(v, out)
    elif isinstance(node, dict):
        if "$t" in node:
            dtype = getattr(torch, str(node["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise StateMismatch(f"unknown dtype {node['dtype']!r} in a state transfer")
            out.append((dtype, [int(d) for d in node["shape"]]))
        else:
            for v in node.get("$tuple", []) + [x for pair in node.get("$dict", []) for x in pair]:
                _specs(v, out)


def _pair(store: keys.Store, tag: str, rank: int, me: int, timeout_s: float) -> Any:
    prefix = dist.PrefixStore(keys.xfer_prefix(tag, rank), store)  # type: ignore[attr-defined, arg-type]  # (stub)
    return dist.ProcessGroupGloo(prefix, me, 2, timedelta(seconds=timeout_s))


@dataclass(frozen=True, slots=True)
class Packed:
    """A state tree ready to send: its skeleton (JSON) and every tensor's bytes in one buffer."""

    skeleton: str
    blob: torch.Tensor


def pack(state: dict[str, Any]) -> Packed:
    """Flatten ``state`` once (a copy of its tensors), for one or several `send_packed`."""
    tensors: list[torch.Tensor] = []
    skeleton = json.dumps(flatten(state, tensors))
    blob = torch.cat([t.cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]) if tensors \
        else torch.empty(0, dtype=torch.uint8)
    return Packed(skeleton, blob)


def send(state: dict[str, Any], *, store: keys.Store, tag: str, rank: int, timeout_s: float) -> int:
    """Send ``state`` to the process taking ``rank`` (`receive` with the same ``tag``); returns bytes sent."""
    return send_packed(pack(state), store=store, tag=tag, rank=rank, timeout_s=timeout_s)


def send_packed(packed: Packed, *, store: keys.Store, tag: str, rank: int, timeout_s: float) -> int:
    """`send` for a state already packed; returns bytes sent."""
    store.set(keys.xfer_prefix(tag, rank) + "skeleton", packed.skeleton)
    store.set(keys.xfer_prefix(tag, rank) + "bytes", str(packed.blob.numel()))
    group = _pair(store, tag, rank, 0, timeout_s)
    if packed.blob.numel():
        group.broadcast([packed.blob], _root0()).wait()
    return int(packed.blob.numel())


def receive(*, store: keys.Store, tag: str, rank: int, timeout_s: float) -> dict[str, Any]:
    """The state `send` sends for ``rank`` under ``tag``."""
    group = _pair(store, tag, rank, 1, timeout_s)
    skeleton = json.loads(store.get(keys.xfer_prefix(tag, rank) + "skeleton"))
    nbytes = int(store.get(keys.xfer_prefix(tag, rank) + "bytes"))
    blob = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        group.broadcast([blob], _root0()).wait()
    specs: list[tuple[torch.dtype, list[int]]] = []
    _specs(skeleton, specs)
    tensors, offset = [], 0
    for dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype)
        n = t.numel() * t.element_size()
        t.reshape(-1).view(torch.uint8).copy_(blob[offset:offset + n])  # a copy: offsets need not be aligned
        tensors.append(t)
        offset += n
    if offset != nbytes:
        raise StateMismatch(f"state transfer for rank {rank}: {nbytes} bytes received, the skeleton names {offset}")
    state = unflatten(skeleton, tensors)
    if not isinstance(state, dict):
        raise StateMismatch(f"state transfer for rank {rank}: not a state tree")
    return state


def _root0() -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts
