"""Torch runtime of Cannikin: HeteroDataParallel, HeteroDataLoader and their blocks.

Names are loaded lazily (PEP 562): ``import cannikin.runtime.sampler`` or
``cannikin.runtime.planner`` does not import torch; touching ``HeteroDataParallel``
does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "HeteroDataParallel": "cannikin.runtime.parallel",
    "HeteroDataLoader": "cannikin.runtime.loader",
    "init_distributed": "cannikin.runtime.distributed",
    "DistContext": "cannikin.runtime.distributed",
    "Planner": "cannikin.runtime.planner",
    "PlannerConfig": "cannikin.runtime.planner",
    "StepReport": "cannikin.runtime.planner",
    "UnevenSampler": "cannikin.runtime.sampler",
    "Preconditioner": "cannikin.runtime.precondition",
}

__all__ = [
    "DistContext", "HeteroDataLoader", "HeteroDataParallel", "Planner", "PlannerConfig",
    "Preconditioner", "StepReport", "UnevenSampler", "init_distributed",
]

if TYPE_CHECKING:  # names for type checkers; at run time __getattr__ loads them lazily
    from cannikin.runtime.distributed import DistContext, init_distributed  # noqa: F401
    from cannikin.runtime.loader import HeteroDataLoader  # noqa: F401
    from cannikin.runtime.parallel import HeteroDataParallel  # noqa: F401
    from cannikin.runtime.planner import Planner, PlannerConfig, StepReport  # noqa: F401
    from cannikin.runtime.precondition import Preconditioner  # noqa: F401
    from cannikin.runtime.sampler import UnevenSampler  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cannikin.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
