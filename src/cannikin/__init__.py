"""Cannikin: optimal data-parallel training on heterogeneous clusters.

Every public name is loaded lazily (PEP 562) so that ``import cannikin`` and the
numpy-only planning modules work on a machine without torch; the runtime names
import torch only when first touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "NodeModel": "cannikin.perf",
    "CommModel": "cannikin.perf",
    "ClusterModel": "cannikin.perf",
    "NodeFitter": "cannikin.perf",
    "CommFitter": "cannikin.perf",
    "PredictionTracker": "cannikin.perf",
    "Plan": "cannikin.optperf",
    "optimal_split": "cannikin.optperf",
    "efficiency": "cannikin.goodput",
    "choose_batch_size": "cannikin.goodput",
    "BatchChoice": "cannikin.goodput",
    "NoiseScaleTracker": "cannikin.gns",
    "LRScaler": "cannikin.scaling",
    "adascale_gain": "cannikin.scaling",
    "Preconditioner": "cannikin.runtime.precondition",
    "HeteroDataParallel": "cannikin.runtime",
    "HeteroDataLoader": "cannikin.runtime",
    "DistContext": "cannikin.runtime.distributed",
    "init_distributed": "cannikin.runtime.distributed",
    "UnevenSampler": "cannikin.runtime.sampler",
    "install_slowdown": "cannikin.runtime.emulate",
    "CheckpointManager": "cannikin.runtime.checkpoint",
    "CheckpointError": "cannikin.runtime.checkpoint",
    "save_training": "cannikin.runtime.checkpoint",
    "resume_training": "cannikin.runtime.checkpoint",
    "JsonlSink": "cannikin.metrics",
    "TensorBoardSink": "cannikin.metrics",
}
_SUBMODULES = ("perf", "optperf", "goodput", "gns", "scaling", "runtime", "sim")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])

if TYPE_CHECKING:  # names for type checkers; at run time __getattr__ loads them lazily
    from cannikin.gns import NoiseScaleTracker  # noqa: F401
    from cannikin.goodput import BatchChoice, choose_batch_size, efficiency  # noqa: F401
    from cannikin.metrics import JsonlSink, TensorBoardSink  # noqa: F401
    from cannikin.optperf import Plan, optimal_split  # noqa: F401
    from cannikin.perf import (  # noqa: F401
        ClusterModel,
        CommFitter,
        CommModel,
        NodeFitter,
        NodeModel,
        PredictionTracker,
    )
    from cannikin.runtime import HeteroDataLoader, HeteroDataParallel  # noqa: F401
    from cannikin.runtime.precondition import Preconditioner  # noqa: F401
    from cannikin.scaling import LRScaler, adascale_gain  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"cannikin.{name}")
    else:
        raise AttributeError(f"module 'cannikin' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
