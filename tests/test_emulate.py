"""Padding slowdown: time ratios, linear fit slopes, per-layer readiness, env parsing."""

import time

import numpy as np
import pytest
import torch
from torch import nn

from cannikin.runtime.emulate import install_slowdown, slowdown_from_env

FIXED_S, PER_SAMPLE_S = 1e-2, 5e-4  # far above the real compute and sleep wake-up lag
BATCHES = (8, 32, 64)
REPEATS = 8


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def time_step(model: nn.Module, batch: int) -> tuple[float, float]:
    x = torch.randn(batch, 16)
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1


def test_factor_three_takes_three_times_as_long_and_slopes_follow() -> None:
    torch.set_num_threads(1)
    models = {1.0: mlp(), 3.0: mlp()}
    for factor, model in models.items():
        time_step(model, 8)  # warm-up before timing
        install_slowdown(model, factor, fixed_s=FIXED_S, per_sample_s=PER_SAMPLE_S)
    samples: dict[tuple[float, int], list[tuple[float, float]]] = {}
    for _ in range(REPEATS):  # interleaved, so a load spike on the shared cores hits both
        for batch in BATCHES:
            for factor, model in models.items():
                samples.setdefault((factor, batch), []).append(time_step(model, batch))
    # the least disturbed of the repeats: a sleep ends late, never early. Beside a busy
    # core a short sleep wakes 2-8 ms late more often than a long one: a median of four
    # read the fast model's forward at 8 samples 24% long (a ratio of 2.43) in one run of
    # the suite on a loaded machine, and a minimum of four failed 4 runs of 9 beside a CPU
    # hog; a minimum of eight passed 8 of 8
    least = {key: np.min(np.array(value), axis=0) for key, value in samples.items()}
    b = np.array(BATCHES, dtype=float)
    for phase, scale in ((0, 1.0), (1, 2.0)):  # forward, backward (2x the forward target)
        fast = np.array([least[1.0, x][phase] for x in BATCHES])
        slow = np.array([least[3.0, x][phase] for x in BATCHES])
        np.testing.assert_allclose(slow / fast, 3.0, rtol=0.15)
        slope_fast, _ = np.polyfit(b, fast, 1)
        slope_slow, icpt_slow = np.polyfit(b, slow, 1)
        assert slope_fast == pytest.approx(scale * PER_SAMPLE_S, rel=0.15)
        assert slope_slow == pytest.approx(3 * scale * PER_SAMPLE_S, rel=0.15)
        assert slope_slow / slope_fast == pytest.approx(3.0, rel=0.15)
        assert icpt_slow == pytest.approx(3 * scale * FIXED_S, rel=0.25)


def test_gradients_become_ready_at_emulated_fractions_of_backward() -> None:
    """The least disturbed of three backwards (the shortest: a sleep ends late, never early;
    beside a CPU hog one backward started 11 ms late, every fraction 0.056 behind)."""
    model = mlp()
    model(torch.randn(4, 16)).sum().backward()  # warm-up before timing
    install_slowdown(model, 2.0, fixed_s=5e-2, per_sample_s=0.0)
    params = [p for p in model.parameters()]
    ready: dict[int, float] = {}
    for i, p in enumerate(params):  # fires after accumulation, where DDP marks a grad ready
        p.register_post_accumulate_grad_hook(lambda _, i=i: ready.update({i: time.perf_counter()}))
    runs = []
    for _ in range(3):
        ready.clear()
        loss = model(torch.randn(4, 16)).sum()
        t0 = time.perf_counter()
        loss.backward()
        runs.append((time.perf_counter() - t0, t0, dict(ready)))
    total, t0, marks = min(runs, key=lambda run: run[0])
    sizes = np.array([p.numel() for p in params])
    order = sorted(marks, key=marks.get)  # backward visits the last layer first
    expected = np.cumsum(sizes[order]) / sizes.sum()
    measured = np.array([marks[i] - t0 for i in order]) / (2 * 2 * 5e-2)
    assert total == pytest.approx(2 * 2 * 5e-2, rel=0.2)
    np.testing.assert_allclose(measured, expected, atol=0.08)


def test_remove_restores_speed_and_output_is_unchanged() -> None:
    model, x = mlp(), torch.randn(8, 16)
    reference = model(x)
    handle = install_slowdown(model, 1.0, fixed_s=0.05, per_sample_s=0.0)
    assert torch.equal(model(x), reference)
    handle.remove()
    t0 = time.perf_counter()
    model(x).sum().backward()
    assert time.perf_counter() - t0 < 0.05
    assert handle.points == 3  # one point per layer with parameters, forward only


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="factor must be > 0, got 0"):
        install_slowdown(mlp(), 0, fixed_s=0.0, per_sample_s=0.0)
    with pytest.raises(ValueError, match="per_sample_s must be >= 0, got -1"):
        install_slowdown(mlp(), 1, fixed_s=0.0, per_sample_s=-1)
    with pytest.raises(ValueError, match="ReLU has no trainable parameters"):
        install_slowdown(nn.ReLU(), 1, fixed_s=0.0, per_sample_s=0.0)


@pytest.mark.parametrize(
    ("value", "rank", "factor"),
    [(None, 2, 1.0), ("", 0, 1.0), ("3", 5, 3.0), ("1,2,4", 0, 1.0), ("1, 2.5,4", 1, 2.5)],
)
def test_slowdown_from_env(value: str | None, rank: int, factor: float) -> None:
    env = {} if value is None else {"CANNIKIN_SLOWDOWN": value}
    assert slowdown_from_env(rank, env) == factor


@pytest.mark.parametrize(
    ("value", "message"),
    [("fast", "must be a number"), ("1,0", "must be > 0"),
     ("1,2", "names 2 ranks but this is rank 2")],
)
def test_slowdown_from_env_errors(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slowdown_from_env(2, {"CANNIKIN_SLOWDOWN": value})


class StepTaker(nn.Module):
    """Forward takes the batch as a list and a step index, as Lightning's training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()


def test_the_batch_is_found_inside_a_list_argument() -> None:
    model = StepTaker()
    handle = install_slowdown(model, 1.0, fixed_s=0.0, per_sample_s=1e-4)
    model([torch.randn(24, 16), torch.zeros(24)], 3)
    assert handle.batch == 24
    model(batch=[torch.randn(5, 16)], index=0)
    assert handle.batch == 5
