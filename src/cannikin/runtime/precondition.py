"""The gradient space the noise scale is measured in.

For SGD-like optimizers the step moves along the gradient, so the noise scale of the raw
gradient is the one that matters.  Adam and AdamW move along the gradient divided by
``sqrt(v_hat) + eps`` (``v_hat`` the bias-corrected second moment), so, as AdaptDL does
for Adam, we measure the noise scale of the gradient preconditioned the same way.  The
preconditioner is the optimizer's state *before* the step, i.e. the one this step's
update will (nearly) use.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

__all__ = ["Preconditioner"]

logger = logging.getLogger(__name__)

_ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW)


class Preconditioner:
    """Maps a parameter's gradient into the optimizer's update space.

    Identity for optimizers other than Adam/AdamW.  For Adam/AdamW it returns
    ``grad / (sqrt(v / (1 - beta2^t)) + eps)`` (``v`` = ``max_exp_avg_sq`` with amsgrad),
    once the parameter has ``warmup_steps`` optimizer steps of state: right after the first
    steps ``v_hat`` is just the last few squared gradients and the preconditioned gradient
    is close to a sign vector, which would make the noise scale meaningless (AdaptDL waits
    5 steps for the same reason).  Until then, and for parameters without state, it is the
    identity.  The returned tensor may be ``grad`` itself: do not modify it in place.

    The measured space changes when the preconditioning starts (:attr:`active` turns True):
    the noise-scale tracker must be reset then, or the raw-gradient steps linger in its
    average (HeteroDataParallel does this).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int = 5) -> None:
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.adaptive = isinstance(optimizer, _ADAPTIVE)
        self._groups: dict[torch.Tensor, dict[str, Any]] = {}
        if not self.adaptive:
            logger.debug(
                "%s is not Adam/AdamW: noise scale measured on raw gradients",
                type(optimizer).__name__,
            )

    @property
    def active(self) -> bool:
        """Whether gradients are being preconditioned (Adam/AdamW past the warm-up)."""
        if not self.adaptive:
            return False
        return any(
            "step" in state and float(state["step"]) >= self.warmup_steps
            for state in self.optimizer.state.values()
        )

    def _group_of(self, param: torch.Tensor) -> dict[str, Any] | None:
        group = self._groups.get(param)
        if group is None:  # param groups may have been added since the last call
            self._groups = {p: g for g in self.optimizer.param_groups for p in g["params"]}
            group = self._groups.get(param)
        return group

    def __call__(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` of ``param`` in the space the noise scale is measured in."""
        if not self.adaptive:
            return grad
        state = self.optimizer.state.get(param)
        if not state or "exp_avg_sq" not in state:
            return grad
        step = float(state["step"])
        if step < self.warmup_steps:
            return grad
        group = self._group_of(param)
        if group is None:
            return grad
        second: torch.Tensor = state["max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"]
        beta2 = float(group["betas"][1])
        correction_sqrt = math.sqrt(1.0 - beta2**step)
        denom = (second.sqrt() / correction_sqrt).add_(float(group["eps"]))
        return grad / denom.to(grad.dtype)
