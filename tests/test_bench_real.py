"""bench_real's paired ratios: per round, against the best plain DDP split, with an interval."""

from __future__ import annotations

import numpy as np
import pytest

from benchmark_modules import load_benchmark


def test_a_ratio_is_taken_within_each_round_so_a_load_shared_by_the_round_cancels() -> None:
    load = [1.0, 1.5, 0.8, 2.0, 1.2]  # the machine's speed, round by round
    blocks = {"Cannikin": [0.0515 * x for x in load], "DDP a": [0.050 * x for x in load],
              "DDP b": [0.060 * x for x in load]}
    paired_ratio = load_benchmark("bench_real")._paired_ratio
    got = paired_ratio(blocks, "Cannikin", None)  # None: the best DDP split, "DDP a"
    assert (got.median, got.q1, got.q3, got.low, got.high) == pytest.approx((1.03,) * 5)


def test_the_medians_interval_holds_it_and_narrows_with_more_rounds() -> None:
    rng = np.random.default_rng(1)
    paired_ratio = load_benchmark("bench_real")._paired_ratio
    widths = []
    for rounds in (10, 80):
        ratios = 1.02 * np.exp(rng.normal(0.0, 0.1, rounds))
        got = paired_ratio({"a": list(ratios), "b": [1.0] * rounds}, "a", "b")
        assert got.low <= got.median <= got.high
        assert min(ratios) <= got.low and got.high <= max(ratios)
        assert got.median == pytest.approx(float(np.median(ratios)))
        widths.append(got.high - got.low)
    assert widths[1] < 0.6 * widths[0]  # ~1/sqrt(8) of it


def test_a_period_whose_quotas_the_kernel_refuses_is_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench_real = load_benchmark("bench_real")
    # 0.25 of a 2 ms period is under the kernel's 1 ms minimum quota
    assert bench_real.launch_on_quotas(bench_real.ROOT / "benchmarks" / "bench_real.py", [],
                                       period_ms=2) == 2
    err = capsys.readouterr().err
    if "CPU quotas unavailable" in err:
        pytest.skip(err.strip())
    assert "bench_real: --period-ms 2: CPU share 0.25 of rank 2 is below" in err
    assert "give at least 0.5 cores" in err


def test_the_best_split_chosen_on_other_rounds_is_not_biased_by_its_own_noise() -> None:
    """Monte Carlo: Cannikin and 14 plain DDP splits all of the same true step, each round's
    blocks sharing the machine's load and each block noisy by itself (10% log-normal, as on
    quota workers). Against the split chosen on the same rounds the median ratio runs over
    1 (the least of 14 noisy medians), against the one chosen on the other half it does not."""
    bench_real = load_benchmark("bench_real")
    rng = np.random.default_rng(2)
    in_sample, held_out = [], []
    for _ in range(150):
        load = np.exp(rng.normal(0.0, 0.2, 20))
        blocks = {name: list(0.045 * load * np.exp(rng.normal(0.0, 0.1, 20)))
                  for name in ["Cannikin", *(f"DDP {k}" for k in range(14))]}
        in_sample.append(bench_real._paired_ratio(blocks, "Cannikin", None, resamples=10).median)
        got, chosen = bench_real._held_out_best_ratio(blocks, "Cannikin", resamples=10)
        held_out.append(got.median)
        assert all(name.startswith("DDP ") for name in chosen)
    assert float(np.mean(in_sample)) > 1.02
    assert abs(float(np.mean(held_out)) - 1.0) < 0.01


def test_the_held_out_ratio_is_taken_against_each_half_s_choice() -> None:
    # DDP a is best on the even rounds, DDP b on the odd: each half is measured against the
    # other's choice.
    blocks = {"Cannikin": [1.0, 1.2, 0.9, 1.1], "DDP a": [0.5, 2.0, 0.5, 2.0],
              "DDP b": [2.0, 0.8, 2.0, 0.8]}
    got, chosen = load_benchmark("bench_real")._held_out_best_ratio(blocks, "Cannikin")
    assert chosen == ("DDP b", "DDP a")  # for the even rounds, chosen on the odd, and back
    # rounds 0 and 2 against b, 1 and 3 against a: 0.5, 0.6, 0.45, 0.55
    assert got.median == pytest.approx(0.525)
    assert got.q1 < got.median < got.q3
