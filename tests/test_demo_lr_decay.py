"""The demo's LR decay (``--lr-decay``): indexed by optimizer steps or by AdaScale's progress."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from cannikin.demo.config import DemoConfig
from cannikin.demo.worker import _lr_schedule

CONFIG = dict(epochs=2, batch_size=50)  # budget 2000 samples of 1000: decay at 20 B0-steps
TRAIN_SIZE = 1000


def _rates(lr_decay: str, gain: float, steps: int) -> list[float]:
    """The optimizer's LR before each of ``steps`` steps, each worth ``gain`` B0-steps."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    model = SimpleNamespace(scaler=SimpleNamespace(progress=0.0))
    scheduler = _lr_schedule(DemoConfig(**CONFIG, lr_decay=lr_decay), optimizer,
                             cast(Any, model), TRAIN_SIZE)
    assert scheduler is not None
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        model.scaler.progress += gain
        scheduler.step()
    return rates


@pytest.mark.parametrize(("lr_decay", "full_rate_steps"), [("steps", 20), ("progress", 5)])
def test_the_decay_counts_what_it_is_told(lr_decay: str, full_rate_steps: int) -> None:
    """Steps worth 4 B0-steps each: the progress reaches 20 after 5 of them, the step count
    after 20."""
    rates = _rates(lr_decay, gain=4.0, steps=30)
    assert rates == [1.0] * full_rate_steps + [pytest.approx(0.1)] * (30 - full_rate_steps)


def test_no_decay_is_no_scheduler() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert _lr_schedule(DemoConfig(**CONFIG), optimizer, cast(Any, None), TRAIN_SIZE) is None
