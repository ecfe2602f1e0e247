"""Atomic, versioned checkpoints that never run code when loaded.

A checkpoint is one ``torch.save`` file holding ``{"format", "version", "state"}``, where the
state is made of tensors, numbers, strings, None and lists/tuples/dicts of them only (numpy
values are converted; anything else is refused when saving). Loading uses
``torch.load(weights_only=True)``, which rejects any other pickled object without executing it.

Writes go to a temporary file in the same directory, are fsynced and then renamed over the
target (``os.replace`` is atomic on POSIX), so a crash mid-write leaves the old file intact.
:class:`CheckpointManager` keeps the last few checkpoints of a run, so that a corrupt newest
file still leaves a good one to resume from. In a multi-worker job only one rank should save.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
