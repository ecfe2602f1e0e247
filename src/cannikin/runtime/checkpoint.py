"""Atomic, versioned checkpoints that never run code when loaded.

A checkpoint is one ``torch.save`` file holding ``{"format", "version", "state"}``, where the
state is made of tensors, numbers, strings, None and lists/tuples/dicts of them only (numpy
values are converted; anything else is refused when saving). Loading uses
``torch.load(weights_only=True)``, which rejects any other pickled object without executing it.

Writes go to a temporary file in the same directory, are fsynced and then renamed over the
target (``os.replace`` is atomic on POSIX), so a crash mid-write leaves the old file intact.
:class:`CheckpointManager` keeps the last few checkpoints of a run, so that a corrupt newest
file still leaves a good one to resume from. In a multi-worker job only one rank should save:
:func:`save_training` and :func:`resume_training` do that for a whole training job (every rank
calls them; rank 0 writes, every rank reads the same file), on top of the same manager.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from cannikin.runtime.step_timeout import startup_timeout

logger = logging.getLogger(__name__)

FORMAT = "cannikin-checkpoint"
VERSION = 1
"""Version of the checkpoint layout; files of another version are refused."""

_PLAIN = (int, float, bool, str, type(None), torch.Tensor)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def to_plain(value: Any, where: str = "state") -> Any:
    """``value`` made of tensors, numbers, strings, None and containers only.

    numpy scalars become Python numbers and numpy arrays become tensors; dict keys must be
    strings or integers. Anything else raises CheckpointError naming where it was found.
    """
    if isinstance(value, np.generic):  # before _PLAIN: np.float64 subclasses float
        return value.item()
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise CheckpointError(f"{where} has a key {key!r} of type {type(key).__name__}; "
                                      "checkpoint keys must be str or int")
            out[key] = to_plain(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        items = [to_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold only "
        "tensors, numbers, strings, None and lists/tuples/dicts of them (use its state_dict())"
    )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename); return the path."""
    path = Path(path)
    payload = {"format": FORMAT, "version": VERSION, "state": to_plain(state)}
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        raise CheckpointError(f"could not write checkpoint {path}: {error}") from error
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike[str],
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The state saved at ``path``; CheckpointError if missing, corrupt, unsafe or another version.

    Never executes code from the file (``weights_only=True``).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises many types for a bad file; all mean "unreadable"
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated, corrupt, or holds objects that a safe "
            f"load refuses): {type(error).__name__}: {str(error)[:300]}"
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Cannikin checkpoint (no {FORMAT!r} header)")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path} has version {payload.get('version')!r}; "
                              f"this code reads version {VERSION}")
    state = payload.get("state")
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} has no state dict")
    return state


class CheckpointManager:
    """Numbered checkpoints ``<prefix>-<step>.pt`` in one directory, the newest ``keep`` kept."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3,
                 prefix: str = "checkpoint") -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (checkpoints to retain), got {keep}")
        if not re.fullmatch(r"[A-Za-z0-9_.]+", prefix):
            raise ValueError(f"prefix must be letters, digits, '_' or '.', got {prefix!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.prefix = prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")

    def path_for(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.directory / f"{self.prefix}-{step:09d}.pt"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every checkpoint present, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = self._pattern.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Save ``state`` as the checkpoint of ``step``, then drop all but the newest ``keep``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = save_checkpoint(self.path_for(step), state)
        for _, old in self.checkpoints()[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def load_latest(self, map_location: str | torch.device = "cpu"
                    ) -> tuple[int, dict[str, Any]] | None:
        """``(step, state)`` of the newest readable checkpoint, or None if there is none.

        A checkpoint that fails to load is skipped with a warning, so a corrupt newest file
        falls back to the previous good one.
        """
        for step, path in reversed(self.checkpoints()):
            try:
                return step, load_checkpoint(path, map_location)
            except CheckpointError as error:
                logger.warning("skipping checkpoint of step %d: %s", step, error)
        return None


# -- whole training jobs ---------------------------------------------------------------------------
class Trainable(Protocol):
    """What a job checkpoint needs from the model wrapper (HeteroDataParallel)."""

    step: int
    device: torch.device

    def training_state_dict(self) -> dict[str, Any]: ...

    def load_training_state_dict(self, state: dict[str, Any]) -> None: ...

    def rank_state_dict(self) -> dict[str, Any]: ...

    def load_rank_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """Where :func:`resume_training` resumed from."""

    step: int
    """Optimizer steps completed when the checkpoint was taken (``model.step`` now)."""
    path: Path
    world_size: int
    """Number of workers that wrote it (per-rank state is restored only if it is this job's)."""
    extra: dict[str, Any]
    """The ``extra`` state given to :func:`save_training` (e.g. an LR scheduler's)."""


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_ranks_ok(error: str | None, what: str) -> None:
    """Raise CheckpointError on every rank if any rank failed (a collective, so it also
    works as the barrier that keeps the ranks together)."""
    rank, world = _rank_and_world()
    errors: list[Any] = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0][0]}"
                              f"{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''}: "
                              f"{failed[0][1]}")


def _rank_state(model: Trainable) -> dict[str, Any]:
    """What only this rank knows: its RNG states and the model wrapper's per-rank state."""
    device = model.device
    return {"cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "model": model.rank_state_dict()}


def _load_rank_state(model: Trainable, state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu_rng"])
    if state["cuda_rng"] is not None and model.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], model.device)
    model.load_rank_state_dict(state["model"])


def save_training(manager: CheckpointManager, model: Trainable, *,
                  extra: Mapping[str, Any] | None = None) -> Path:
    """Checkpoint a training job as step ``model.step``; every rank calls it, after
    ``optimizer.step()``.

    Rank 0 writes ``model.training_state_dict()`` (model, optimizer, loader position, planner
    with its fitted models and noise scale, LR scaler), every rank's own state (RNG, the
    last step's measurements not yet exchanged) and ``extra``
    through ``manager`` (atomic, the newest ``keep`` kept). Returns on every rank only once
    the file is complete; a failed write raises CheckpointError on every rank.
    """
    with startup_timeout(model):  # the others wait while rank 0 writes
        rank, world = _rank_and_world()
        ranks: list[Any] = [_rank_state(model)]
        if world > 1:
            ranks = [None] * world
            dist.all_gather_object(ranks, _rank_state(model))
        path = manager.path_for(model.step)
        error = None
        if rank == 0:
            state = {"training": model.training_state_dict(), "ranks": ranks, "world_size": world,
                     "extra": dict(extra or {})}
            try:
                manager.save(model.step, state)
            except CheckpointError as exc:
                error = str(exc)
        _all_ranks_ok(error, f"saving checkpoint {path}")
    logger.info("checkpoint of step %d written to %s", model.step, path)
    return path


def resume_training(manager: CheckpointManager, model: Trainable,
                    map_location: str | torch.device = "cpu") -> Resumed | None:
    """Restore the newest readable checkpoint into ``model`` on every rank; None if none.

    Every rank calls it before training. Rank 0 chooses the checkpoint (a corrupt or
    truncated newest one is skipped with a warning, falling back to the previous good one)
    and every rank loads that same file, so the directory must be visible to all ranks.
    Per-rank state (RNG, unexchanged measurements) is restored when the world size is the
    one that saved it: then a run with a fixed split continues bitwise as if never stopped.
    """
    rank, world = _rank_and_world()
    chosen: list[Any] = [None]
    state: dict[str, Any] | None = None
    if rank == 0:
        latest = manager.load_latest(map_location)
        if latest is not None:
            chosen[0], state = latest
    if world > 1:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    step = int(chosen[0])
    path = manager.path_for(step)
    error = None
    try:
        if state is None:
            state = load_checkpoint(path, map_location)
        if not {"training", "ranks", "world_size", "extra"} <= set(state):
            raise CheckpointError(f"{path} is not a training checkpoint (keys {sorted(state)}); "
                                  "write it with save_training()")
        model.load_training_state_dict(state["training"])
        if int(state["world_size"]) == world:
            _load_rank_state(model, state["ranks"][rank])
    except (CheckpointError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    _all_ranks_ok(error, f"resuming from {path}")
    assert state is not None
    saved_world = int(state["world_size"])
    if saved_world != world:
        logger.info("checkpoint written by %d workers, resuming on %d: per-rank state (RNG, "
                    "last step's measurements) not restored", saved_world, world)
    logger.info("resumed from %s (step %d)", path, step)
    return Resumed(step=step, path=path, world_size=saved_world, extra=dict(state["extra"]))
