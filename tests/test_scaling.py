"""cannikin.scaling without torch: gain formula, rules, LRScaler on a duck-typed optimizer."""

from __future__ import annotations

import json
import math

import pytest

from cannikin import scaling


class FakeOptimizer:
    """Just ``param_groups``, as LRScaler requires."""

    def __init__(self, *lrs: float) -> None:
        self.param_groups = [{"lr": lr, "params": []} for lr in lrs]


def adaptdl_gain(var_at_init_batch: float, sqr: float, scale: float) -> float:
    """AdaptDL's AdaScale gain, in its units: var is the variance at the initial batch."""
    return (var_at_init_batch + sqr) / (var_at_init_batch / scale + sqr)


@pytest.mark.parametrize(("b0", "b", "sqr", "var"), [
    (32, 128, 0.5, 40.0), (64, 64, 1.0, 3.0), (16, 1024, 1e-3, 5.0), (128, 256, 2.0, 0.0),
    (50, 20, 0.3, 9.0),
])
def test_gain_matches_adaptdl_with_per_sample_variance(b0, b, sqr, var) -> None:
    ours = scaling.adascale_gain(b, b0, sqr, var)
    assert ours == pytest.approx(adaptdl_gain(var / b0, sqr, b / b0))
    # statistical efficiency = gain / scale = (phi + B0) / (phi + B) with phi = S / |G|^2
    phi = var / sqr
    assert ours / (b / b0) == pytest.approx((phi + b0) / (phi + b))
    lo, hi = sorted((1.0, b / b0))
    assert lo - 1e-12 <= ours <= hi + 1e-12


def test_gain_limits_and_unknowns() -> None:
    assert scaling.adascale_gain(256, 32, 0.0, 7.0) == pytest.approx(8.0)  # pure noise: linear
    assert scaling.adascale_gain(256, 32, 3.0, 0.0) == 1.0  # no noise: no gain
    assert scaling.adascale_gain(256, 32, None, None) == 1.0
    assert scaling.adascale_gain(256, 32, 0.0, 0.0) == 1.0
    assert scaling.adascale_gain(256, 32, -1.0, 7.0) == pytest.approx(8.0)  # clamped
    with pytest.raises(ValueError, match="total_batch"):
        scaling.adascale_gain(0, 32, 1.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        scaling.adascale_gain(64, 32, float("nan"), 1.0)


def test_rules_by_name() -> None:
    assert scaling.lr_factor("linear", 96, 32) == 3.0
    assert scaling.lr_factor("sqrt", 128, 32) == 2.0
    assert scaling.lr_factor("none", 128, 32, 1.0, 1.0) == 1.0
    assert scaling.lr_factor("adascale", 128, 32, 1.0, 32.0) == pytest.approx(2 / 1.25)
    assert scaling.lr_factor("adamscale", 128, 32, 1.0, 32.0) == pytest.approx(math.sqrt(1.6))
    with pytest.raises(ValueError, match="valid rules are"):
        scaling.lr_factor("cubic", 128, 32)
    with pytest.raises(ValueError, match="valid rules are"):
        scaling.LRScaler(FakeOptimizer(0.1), "cubic", init_batch=32)


def test_scaler_multiplies_then_restores_exactly() -> None:
    opt = FakeOptimizer(0.1, 0.03)
    scaler = scaling.LRScaler(opt, "sqrt", init_batch=32)
    factor = scaler.step_begin(288, None, None)
    assert factor == pytest.approx(3.0) and scaler.last_factor == factor
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.3, 0.09])
    scaler.step_end()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.03]  # bit-exact
    with pytest.raises(RuntimeError, match="without a matching step_begin"):
        scaler.step_end()


def test_abandoned_step_is_restored_before_the_next() -> None:
    opt = FakeOptimizer(0.1)
    scaler = scaling.LRScaler(opt, "linear", init_batch=10)
    scaler.step_begin(20, None, None)
    scaler.step_begin(30, None, None)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)
    scaler.step_end()
    assert opt.param_groups[0]["lr"] == 0.1 and scaler.steps == 1


def test_progress_sums_adascale_gains_whatever_the_rule() -> None:
    opt = FakeOptimizer(1.0)
    scaler = scaling.LRScaler(opt, "linear", init_batch=32)
    steps = [(32, 1.0, 10.0), (128, 1.0, 100.0), (256, 0.5, 50.0), (64, None, None)]
    for total, sqr, var in steps:
        scaler.step_begin(total, sqr, var)
        scaler.step_end()
    expected = sum(scaling.adascale_gain(t, 32, s, v) for t, s, v in steps)
    assert scaler.progress == pytest.approx(expected)
    assert scaler.progress_epochs(640) == pytest.approx(expected * 32 / 640)


def test_state_round_trips_and_converts_init_batch() -> None:
    opt = FakeOptimizer(1.0)
    scaler = scaling.LRScaler(opt, init_batch=32)
    for _ in range(3):
        scaler.step_begin(128, 1.0, 64.0)
        scaler.step_end()
    state = json.loads(json.dumps(scaler.state_dict()))
    same = scaling.LRScaler(FakeOptimizer(1.0), init_batch=32)
    same.load_state_dict(state)
    assert same.state_dict() == scaler.state_dict()
    other = scaling.LRScaler(FakeOptimizer(1.0), init_batch=64)
    other.load_state_dict(state)
    assert other.progress * 64 == pytest.approx(scaler.progress * 32)  # same samples' worth
    with pytest.raises(ValueError, match="keys"):
        other.load_state_dict({"progress": 1.0})
    with pytest.raises(ValueError, match="progress"):
        other.load_state_dict({**state, "progress": math.nan})
