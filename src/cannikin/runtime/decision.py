"""What a re-plan chose, as a vector one rank sends the others.

Every rank fits the same models from the same exchanged reports, but choosing the split
(the optimal split, the held-split check, the zero-sample and probe choices, the costly
workers) took a quarter-core worker 30-40 ms a re-plan where a full core takes ~7 ms, and
every rank waits for the slowest. So one rank decides (:attr:`Planner.decider`) and the
others adopt its :class:`Decision`; pure numpy, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cannikin.optperf import CostlyWorker

KINDS = ("plan", "explore", "probe", "try", "failed")
"""A split chosen for speed; a larger total batch to learn the fixed cost (``adaptdl``);
a probe of one worker at another batch size; a trial of one worker at 0 samples; the
deciding rank's re-plan raised (the others raise too instead of waiting)."""
_HEAD = 4  # kind, rank, target, predicted


@dataclass(frozen=True)
class Decision:
    """A re-plan's choice: the split and what the planner's state keeps of how it chose."""

    local_batches: tuple[int, ...]
    predicted_s: float | None
    kind: str = "plan"
    rank: int = -1
    """The worker probed (``probe``) or tried at 0 samples (``try``); -1 otherwise."""
    target: int = 0
    """The probed worker's local batch (``probe``)."""
    idle_until: dict[int, int] = field(default_factory=dict)
    """Workers a trial showed faster at 0 samples, and the step until which they stay there."""
    costly: tuple[CostlyWorker, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"decision kind {self.kind!r} is not one of {KINDS}")

    def reason(self, given: str) -> str:
        """The plan's reason: ``given`` for a split chosen for speed, else what it explores."""
        if self.kind == "explore":
            return f"explore total batch {sum(self.local_batches)}"
        if self.kind == "probe":
            return f"probe worker {self.rank} at local batch {self.target}"
        if self.kind == "try":
            return f"try worker {self.rank} at 0 samples"
        return given

    @staticmethod
    def size(world_size: int) -> int:
        """Length of the vector of a decision for ``world_size`` workers."""
        return _HEAD + 4 * world_size

    def to_vector(self) -> np.ndarray:
        """float64: kind, rank, target, predicted (NaN: none), the split, each worker's idle
        step (-1: none), each worker's costly step times (NaN: not costly)."""
        n = len(self.local_batches)
        vector = np.full(self.size(n), math.nan)
        predicted = math.nan if self.predicted_s is None else self.predicted_s
        vector[:_HEAD] = (KINDS.index(self.kind), self.rank, self.target, predicted)
        vector[_HEAD:_HEAD + n] = self.local_batches
        vector[_HEAD + n:_HEAD + 2 * n] = [self.idle_until.get(r, -1) for r in range(n)]
        for worker in self.costly:
            vector[_HEAD + 2 * n + 2 * worker.rank] = worker.step_time
            vector[_HEAD + 2 * n + 2 * worker.rank + 1] = worker.without_step_time
        return vector

    @classmethod
    def failed(cls, world_size: int) -> Decision:
        """What the deciding rank sends when its re-plan raised."""
        return cls(local_batches=(0,) * world_size, predicted_s=None, kind="failed")

    @classmethod
    def from_vector(cls, vector: np.ndarray) -> Decision:
        """The inverse of :meth:`to_vector`."""
        values = np.asarray(vector, dtype=np.float64)
        n, rest = divmod(values.size - _HEAD, 4)
        if n < 1 or rest:
            raise ValueError(f"a decision vector has {_HEAD} + 4 * world_size entries, got "
                             f"{values.size}")
        kind, rank, target, predicted = values[:_HEAD]
        idle = values[_HEAD + n:_HEAD + 2 * n]
        times = values[_HEAD + 2 * n:].reshape(n, 2)
        return cls(local_batches=tuple(int(b) for b in values[_HEAD:_HEAD + n]),
                   predicted_s=None if math.isnan(predicted) else float(predicted),
                   kind=KINDS[int(kind)], rank=int(rank), target=int(target),
                   idle_until={r: int(end) for r, end in enumerate(idle) if end >= 0},
                   costly=tuple(CostlyWorker(rank=r, step_time=float(t[0]),
                                             without_step_time=float(t[1]))
                                for r, t in enumerate(times) if not math.isnan(t[0])))
