"""Emulate a slower device on this machine by *padding* each layer's time (DESIGN §5).

The model computes once at its real speed; then hooks sleep until the time a device
``factor`` times slower than a reference would have reached at that point:

    forward target  = factor * (fixed_s + per_sample_s * batch)
    backward target = backward_scale * forward target

The targets are spread over the parameters in proportion to their size, as a cumulative
schedule: after each layer's forward, and just before each parameter's gradient is
accumulated in backward, the worker sleeps until ``start + (share done so far) * target``.
DDP marks a gradient ready after accumulation, so its buckets become ready at the emulated
times and communication overlaps a slow backward as it would on a slow device.
Sleeping instead of repeating the compute leaves the cores to the other workers, and set
above the real (contended) cost, ``fixed_s`` and ``per_sample_s`` give an exact linear time
model; :attr:`SlowdownHandle.late` counts the points where the real compute overran it.
Backward time of a parameter that gets no gradient (unused in this step) is not padded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)

ENV_VAR = "CANNIKIN_SLOWDOWN"


@dataclass
class _Schedule:
    """Where one forward or backward pass stands against its target."""

    start: float = 0.0
    target_s: float = 0.0
    done: float = 0.0  # fraction of the target's schedule reached so far


@dataclass
class SlowdownHandle:
    """Hooks of one :func:`install_slowdown`; ``remove()`` restores the module's speed."""

    factor: float
    fixed_s: float
    per_sample_s: float
    backward_scale: float
    batch: int = 0
    points: int = 0
    """Padding points passed (layer ends in forward, gradients in backward)."""
    late: int = 0
    """Points where the real compute had already overrun the emulated schedule."""
    _forward: _Schedule = field(default_factory=_Schedule)
    _backward: _Schedule = field(default_factory=_Schedule)
    _hooks: list[RemovableHandle] = field(default_factory=list)

    def forward_target_s(self, batch: int) -> float:
        """Emulated forward time of ``batch`` samples."""
        return self.factor * (self.fixed_s + self.per_sample_s * batch)

    def remove(self) -> None:
        """Remove every hook this slowdown installed (safe to call twice)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _advance(self, schedule: _Schedule, share: float) -> None:
        schedule.done = min(1.0, schedule.done + share)  # a layer run twice cannot overshoot
        self._wait_until(schedule.start + schedule.done * schedule.target_s)

    def _wait_until(self, deadline: float) -> None:
        self.points += 1
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        else:
            self.late += 1


def _batch_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The first dimension of the first tensor with one among the arguments, looked for
    inside lists, tuples and mappings too (Lightning's ``training_step(batch, batch_idx)``
    gets the batch as a list)."""
    for value in _tensors([*args, *kwargs.values()]):
        if value.dim() > 0:
            return int(value.shape[0])
    return 0


def install_slowdown(module: nn.Module, factor: float, *, fixed_s: float, per_sample_s: float,
                     backward_scale: float = 2.0) -> SlowdownHandle:
    """Make ``module`` take ``factor * (fixed_s + per_sample_s * batch)`` per forward pass.

    Backward takes ``backward_scale`` times the forward target. The batch is the first
    dimension of the first tensor among the arguments of ``module``'s forward. Install on
    the bare model (before wrapping it in DDP, or on ``ddp.module``); ``factor`` 1 with the
    same ``fixed_s`` and ``per_sample_s`` is the reference device, so set them above the
    real compute time.
    """
    for name, value in (("factor", factor), ("backward_scale", backward_scale)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    for name, value in (("fixed_s", fixed_s), ("per_sample_s", per_sample_s)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    params = [p for p in module.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    if total == 0:
        raise ValueError(f"{type(module).__name__} has no trainable parameters to pad around")
    handle = SlowdownHandle(factor=factor, fixed_s=fixed_s, per_sample_s=per_sample_s,
                            backward_scale=backward_scale)

    def start_forward(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.batch = _batch_size(args, kwargs)
        handle._forward = _Schedule(time.perf_counter(), handle.forward_target_s(handle.batch))

    def end_forward(_: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        left = 1.0 - handle._forward.done  # > 0 only if some layer did not run
        if left > 1e-9:
            handle._advance(handle._forward, left)
        first = next((t for t in _tensors(output) if t.requires_grad), None)
        if first is not None:
            first.register_hook(start_backward)  # type: ignore[no-untyped-call]

    def start_backward(grad: torch.Tensor) -> None:
        target = handle.backward_scale * handle.forward_target_s(handle.batch)
        handle._backward = _Schedule(time.perf_counter(), target)

    handle._hooks.append(module.register_forward_pre_hook(start_forward, with_kwargs=True))
    for owner in module.modules():
        own = [p for p in owner.parameters(recurse=False) if p.requires_grad]
        if owner is module or not own:
            continue
        share = sum(p.numel() for p in own) / total
        handle._hooks.append(owner.register_forward_hook(
            lambda *_, share=share: handle._advance(handle._forward, share)))
    handle._hooks.append(module.register_forward_hook(end_forward))
    for param in params:
        share = param.numel() / total
        handle._hooks.append(param.register_hook(  # type: ignore[no-untyped-call]
            lambda grad, share=share: handle._advance(handle._backward, share)))
    return handle


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def slowdown_from_env(rank: int, env: Mapping[str, str] | None = None) -> float:
    """This rank's slowdown factor from ``CANNIKIN_SLOWDOWN``.

    "3" slows every rank by 3; "1,2,4" gives rank r the r-th factor; unset or empty is 1.0.
    """
    raw = (os.environ if env is None else env).get(ENV_VAR, "").strip()
    if not raw:
        return 1.0
    try:
        factors = [float(part) for part in raw.split(",")]
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be a number or comma-separated numbers, "
                         f"got {raw!r}") from None
    if any(not f > 0 for f in factors):
        raise ValueError(f"{ENV_VAR} factors must be > 0, got {raw!r}")
    if len(factors) == 1:
        return factors[0]
    if not 0 <= rank < len(factors):
        raise ValueError(f"{ENV_VAR}={raw!r} names {len(factors)} ranks but this is rank {rank}")
    return factors[rank]
