"""Metrics sinks for ``HeteroDataParallel(metrics=...)``: JSON lines and TensorBoard.

A sink is any object with ``log(metrics, step)``; HeteroDataParallel calls it on rank 0
after every step with the split, the measured and predicted step time, the LR factor, the
noise scale and the rest listed in docs/runtime.md. These two cover the usual places:
one JSON object per line (for pandas, jq, a live tail), and TensorBoard scalars. Neither
imports torch until it is used with TensorBoard.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any, Protocol

SCALARS = ("step_time_s", "predicted_step_time_s", "total_batch", "lr_factor", "noise_scale",
           "fwd_s", "bwd_s", "cpu_s")
"""The per-step figures written as TensorBoard scalars (each under ``cannikin/``)."""


def json_safe(value: Any) -> Any:
    """JSON-safe copy: tuples become lists, NaN and infinities become None."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy / torch scalars, arrays
        return json_safe(value.tolist())
    return value


class JsonlSink:
    """Appends one JSON object per step to ``path`` (flushed each time, so a reader that
    tails the file sees whole lines), tagged with fixed fields (e.g. the run's name)."""

    def __init__(self, path: str | Path, **tags: Any) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._tags = tags

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {**json_safe(metrics), **self._tags, "step": int(step)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ScalarWriter(Protocol):
    """What :class:`TensorBoardSink` needs of ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...

    def flush(self) -> Any: ...


class TensorBoardSink:
    """Writes :data:`SCALARS` and each worker's local batch (``cannikin/local_batch/rank<i>``)
    as TensorBoard scalars. ``writer`` is a ``SummaryWriter`` (share the one your script
    logs its loss with) or a log directory for a new one; figures a step does not have (no
    model yet, an unmeasured step) are left out rather than written as 0."""

    def __init__(self, writer: ScalarWriter | str | Path, *, flush_every: int = 50) -> None:
        if isinstance(writer, str | Path):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(f"TensorBoardSink({str(writer)!r}) needs the tensorboard "
                                  f"package: pip install tensorboard") from error
            writer = SummaryWriter(log_dir=str(writer))
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.writer = writer
        self.flush_every = flush_every

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for name in SCALARS:
            value = metrics.get(name)
            if isinstance(value, int | float) and math.isfinite(value):
                self.writer.add_scalar(f"cannikin/{name}", float(value), step)
        for rank, batch in enumerate(metrics.get("local_batches") or ()):
            self.writer.add_scalar(f"cannikin/local_batch/rank{rank}", float(batch), step)
        if step % self.flush_every == 0:
            self.writer.flush()
