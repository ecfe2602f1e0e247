"""Learning-rate scaling for a total batch ``B`` against the initial batch ``B0``.

Rules (``s = B / B0``):

- ``"adascale"``: the AdaScale gain ``r = (S/B0 + |G|^2) / (S/B + |G|^2)`` with ``S`` the
  PER-SAMPLE ``tr(Sigma)`` (as :mod:`cannikin.gns` reports it).  AdaptDL writes the same
  gain as ``(var + sqr) / (var/s + sqr)`` with ``var = S/B0``; feeding a per-sample ``S``
  into that formula would scale the LR wrongly by a factor depending on ``B0``.
- ``"adamscale"``: ``sqrt(r)``, AdaptDL's variant of AdaScale for Adam, AdamW and RMSProp,
  whose update size does not grow with the gradient the way SGD's does.
- ``"linear"``: ``s``;  ``"sqrt"``: ``sqrt(s)``;  ``"none"``: 1.

:class:`LRScaler` applies the factor to an optimizer for the duration of one step and puts
the user's learning rates back afterwards, so a user's LR scheduler keeps working and the
factor multiplies its schedule.  It is duck-typed on ``optimizer.param_groups`` (no torch).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal, Protocol

__all__ = ["RULES", "LRScaler", "Rule", "adascale_gain", "lr_factor"]

logger = logging.getLogger(__name__)

Rule = Literal["adascale", "adamscale", "linear", "sqrt", "none"]
RULES: tuple[str, ...] = ("adascale", "adamscale", "linear", "sqrt", "none")

_STATE_VERSION = 1


class _HasParamGroups(Protocol):
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


def _check_batches(total_batch: float, init_batch: float) -> None:
    if not (total_batch > 0 and math.isfinite(total_batch)):
        raise ValueError(f"total_batch must be finite and > 0, got {total_batch}")
    if not (init_batch > 0 and math.isfinite(init_batch)):
        raise ValueError(f"init_batch must be finite and > 0, got {init_batch}")


def adascale_gain(
    total_batch: float,
    init_batch: float,
    grad_sqr: float | None,
    grad_var: float | None,
) -> float:
    """AdaScale gain ``(S/B0 + G2) / (S/B + G2)``; ``grad_var`` is the per-sample ``S``.

    Negative estimates are clamped at 0.  With unknown statistics (None) or ``S = G2 = 0``
    the gain is 1: without evidence of noise, do not raise the learning rate.  The gain lies
    between 1 and ``B/B0`` either way: in ``[1, B/B0]`` for ``B >= B0``, in ``[B/B0, 1]``
    for ``B < B0`` (an epoch's final partial batch lowers the rate).
    """
    _check_batches(total_batch, init_batch)
    if grad_sqr is None or grad_var is None:
        return 1.0
    if not (math.isfinite(grad_sqr) and math.isfinite(grad_var)):
        raise ValueError(f"grad_sqr and grad_var must be finite, got {grad_sqr}, {grad_var}")
    sqr, var = max(grad_sqr, 0.0), max(grad_var, 0.0)
    denom = var / total_batch + sqr
    if denom <= 0.0:
        return 1.0
    return (var / init_batch + sqr) / denom


def lr_factor(
    rule: str,
    total_batch: float,
    init_batch: float,
    grad_sqr: float | None = None,
    grad_var: float | None = None,
) -> float:
    """The learning-rate multiplier of ``rule`` (one of :data:`RULES`) at ``total_batch``."""
    _check_batches(total_batch, init_batch)
    scale = total_batch / init_batch
    if rule == "adascale":
        return adascale_gain(total_batch, init_batch, grad_sqr, grad_var)
    if rule == "adamscale":
        return math.sqrt(adascale_gain(total_batch, init_batch, grad_sqr, grad_var))
    if rule == "linear":
        return scale
    if rule == "sqrt":
        return math.sqrt(scale)
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown LR scaling rule {rule!r}; valid rules are {list(RULES)}")


class LRScaler:
    """Scales an optimizer's learning rates for one step at a time.

    Call :meth:`step_begin` just before ``optimizer.step()`` (it multiplies every param
    group's ``lr`` by the rule's factor) and :meth:`step_end` just after (it restores the
    values it found, exactly).  Between the two, nothing else should change ``lr``.
    :attr:`progress` accumulates the AdaScale gain of every completed step whatever the
    rule: scale-invariant iterations, i.e. the number of ``B0``-sized steps of equivalent
    statistical progress (AdaptDL's ``progress``).
    """

    def __init__(
        self, optimizer: _HasParamGroups, rule: str = "adascale", *, init_batch: float
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown LR scaling rule {rule!r}; valid rules are {list(RULES)}")
        _check_batches(init_batch, init_batch)
        self.optimizer = optimizer
        self.rule = rule
        self.init_batch = float(init_batch)
        self.progress = 0.0
        self.steps = 0
        self.last_factor = 1.0
        self._saved_lrs: list[Any] | None = None
        self._pending_gain = 0.0

    def step_begin(
        self, total_batch: float, grad_sqr: float | None, grad_var: float | None
    ) -> float:
        """Multiply each group's ``lr`` by the factor for ``total_batch``; return the factor.

        ``grad_sqr`` / ``grad_var`` are ``|G|^2`` and the per-sample ``tr(Sigma)`` (None when
        not yet known).  Calling it twice without :meth:`step_end` first restores the
        previous step's values (the step was abandoned), then applies the new factor.
        """
        factor = lr_factor(self.rule, total_batch, self.init_batch, grad_sqr, grad_var)
        gain = adascale_gain(total_batch, self.init_batch, grad_sqr, grad_var)
        if self._saved_lrs is not None:
            logger.warning("step_begin called twice without step_end; restoring the LR first")
            self._restore()
        groups = self.optimizer.param_groups
        self._saved_lrs = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * factor
        self.last_factor = factor
        self._pending_gain = gain
        return factor

    def step_end(self) -> None:
        """Restore the learning rates saved by :meth:`step_begin` and count the step."""
        if self._saved_lrs is None:
            raise RuntimeError("LRScaler.step_end called without a matching step_begin")
        self._restore()
        self.progress += self._pending_gain
        self.steps += 1

    def _restore(self) -> None:
        assert self._saved_lrs is not None
        groups = self.optimizer.param_groups
        if len(groups) != len(self._saved_lrs):
            raise RuntimeError(
                f"the optimizer had {len(self._saved_lrs)} param groups at step_begin and "
                f"{len(groups)} at step_end; add param groups outside a step"
            )
        for group, lr in zip(groups, self._saved_lrs, strict=True):
            group["lr"] = lr
        self._saved_lrs = None

    def progress_epochs(self, dataset_size: int) -> float:
        """Progress as equivalent epochs at the initial batch size."""
        if dataset_size <= 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        return self.progress * self.init_batch / dataset_size

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers only (JSON / ``torch.load(weights_only=True)`` safe)."""
        return {
            "version": _STATE_VERSION,
            "init_batch": self.init_batch,
            "progress": self.progress,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore :meth:`state_dict`.

        Progress is kept in samples' worth: a state saved with another ``init_batch`` is
        converted (``progress * old_B0 / new_B0``).
        """
        expected = {"version", "init_batch", "progress", "steps"}
        if set(state) != expected:
            raise ValueError(
                f"LR scaler state must have keys {sorted(expected)}, got {sorted(state)}"
            )
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"LR scaler state version {state['version']} is not supported "
                f"(expected {_STATE_VERSION})"
            )
        old_b0, progress = float(state["init_batch"]), float(state["progress"])
        steps = state["steps"]
        if not (old_b0 > 0 and math.isfinite(old_b0)):
            raise ValueError(f"LR scaler state has invalid init_batch {old_b0}")
        if not (progress >= 0 and math.isfinite(progress)):
            raise ValueError(f"LR scaler state has invalid progress {progress}")
        if int(steps) != steps or steps < 0:
            raise ValueError(f"LR scaler state has invalid steps {steps}")
        if old_b0 != self.init_batch:
            logger.info(
                "converting progress from init_batch %s to %s", old_b0, self.init_batch
            )
        self.progress = progress * old_b0 / self.init_batch
        self.steps = int(steps)
