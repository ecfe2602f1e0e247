"""Simulator: the timeline against hand-computed cases, policies blind to the ground truth,
determinism, the planner's oracle against brute force, and the CLIs."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest

from cannikin.cli import main
from cannikin.optperf import optimal_split, share_split
from cannikin.sim import (
    SCENARIOS,
    ClusterSpec,
    GroundTruth,
    NoiseConfig,
    SimConfig,
    Slowdown,
    cluster_from_arg,
    compare,
)
from cannikin.sim import workload as get_workload
from cannikin.sim.cluster import spec_from_dict
from cannikin.sim.engine import drive, make_context, make_policy, run_policy
from cannikin.sim.measure import Measurement, PolicyContext
from cannikin.sim.policies import LEARNING_POLICIES
from cannikin.sim.profiles import devices, workloads
from cannikin.sim.truth import StepBlock, timeline

QUIET = NoiseConfig(compute_cv=0.0, comm_cv=0.0, spike_prob=0.0)


def short(name: str = "resnet18-cifar10", epochs: float = 2.0):
    return dataclasses.replace(get_workload(name), target_epochs=epochs)


SMALL = ClusterSpec(devices=("A100", "V100", "T4", "T4"), bandwidth_gbps=25.0,
                    latency_us=500.0, name="small")


# --- timeline -----------------------------------------------------------------------------

def test_timeline_one_bucket_two_workers() -> None:
    # worker 0: fwd 1 + bwd 3 = 4; worker 1: 2 + 1 = 3; the bucket starts at 4, takes 0.5
    step = timeline(np.array([[1.0, 2.0]]), np.array([[3.0, 1.0]]), np.array([1.0]),
                    np.array([[0.5]]))
    assert step[0] == pytest.approx(4.5)


def test_timeline_two_buckets_overlap_and_queue() -> None:
    fwd, bwd, ready = np.array([[1.0, 2.0]]), np.array([[3.0, 1.0]]), np.array([0.5, 1.0])
    # bucket 1 ready at max(1 + 1.5, 2 + 0.5) = 2.5, done 3.5; bucket 2 ready at 4 -> 4.5
    assert timeline(fwd, bwd, ready, np.array([[1.0, 0.5]]))[0] == pytest.approx(4.5)
    # a long first all-reduce delays the second: 2.5 + 3 = 5.5, then 5.5 + 0.5
    assert timeline(fwd, bwd, ready, np.array([[3.0, 0.5]]))[0] == pytest.approx(6.0)


def test_ground_truth_two_workers_by_hand() -> None:
    spec = ClusterSpec(devices=("V100", "V100"), bandwidth_gbps=8.0, latency_us=100.0)
    wl = dataclasses.replace(get_workload("resnet50-imagenet"), buckets=((1.0, 1.0),))
    truth = GroundTruth(spec, wl, QUIET)
    # ring all-reduce: latency + 2 (n - 1) / n * bytes / bandwidth, with n = 2
    expected_comm = 100e-6 + 1.0 * 4 * wl.params / 1e9
    assert truth.allreduce_s[0] == pytest.approx(expected_comm)
    b = np.array([64, 32])
    rate = wl.v100_samples_per_s
    knee = wl.knee_v100
    opt = wl.params * wl.state_bytes_per_param / 900e9
    compute = [wl.overhead_ms * 1e-3 + opt + math.sqrt(x * x + knee * knee) / rate for x in b]
    assert truth.expected_step_time(b) == pytest.approx(max(compute) + expected_comm)


def test_compute_is_sublinear_at_small_batches_and_stragglers_apply() -> None:
    spec = ClusterSpec(devices=("V100", "V100"), slowdowns=(
        Slowdown(worker=1, factor=2.0, start_s=10.0, duration_s=5.0),))
    truth = GroundTruth(spec, get_workload("resnet50-imagenet"), QUIET)
    per_sample = [sum(truth.expected_compute(np.array([b, b]))) [0] / b for b in (1, 8, 256)]
    assert per_sample[0] > per_sample[1] > per_sample[2]
    before, during, after = (truth.expected_compute(np.array([32, 32]), t)[0] for t in (0, 12, 16))
    assert during[1] > 1.5 * before[1] and during[0] == before[0]
    assert after[1] == pytest.approx(before[1])


def test_noisy_steps_average_to_the_expected_step() -> None:
    truth = GroundTruth(SMALL, get_workload("resnet50-imagenet"),
                        NoiseConfig(compute_cv=0.03, comm_cv=0.03, spike_prob=0.0))
    b = np.array([100, 40, 16, 16])
    block = truth.run_steps(b, 0.0, 2000, np.random.default_rng(1))
    # noise enters a max, so the mean is a little above the noise-free step
    assert 1.0 <= block.step_s.mean() / truth.expected_step_time(b) < 1.05


def test_simulated_gradient_norms_match_the_noise_model() -> None:
    truth = GroundTruth(SMALL, get_workload("resnet18-cifar10"))
    b = np.array([64, 32, 8, 8])
    local, glob = truth.gradient_sqnorms(b, 0.5, 4000, np.random.default_rng(2))
    g2 = truth.grad_sqr(0.5)
    s = truth.noise_scale(0.5) * g2
    np.testing.assert_allclose(local.mean(axis=0), g2 + s / b, rtol=0.03)
    assert glob.mean() == pytest.approx(g2 + s / b.sum(), rel=0.03)


# --- profiles and cluster files ------------------------------------------------------------

def test_every_workload_fits_every_device_and_profiles_cite_sources() -> None:
    assert {"A100", "V100", "T4", "P100", "RTX6000", "A10", "H100"} <= set(devices())
    for d in devices().values():
        assert d.source
        for w in workloads().values():
            assert w.max_local_batch(d) >= 1, (d.name, w.name)
    assert {"resnet18-cifar10", "resnet50-imagenet", "bert-base-squad",
            "gpt-small-lm"} <= set(workloads())


def test_cluster_dict_parsing_and_errors() -> None:
    spec = spec_from_dict({"network": {"bandwidth_gbps": 10}, "workers": [
        {"device": "A100", "count": 2}, {"device": "rtx 6000"}],
        "stragglers": [{"worker": 2, "factor": 2.0, "start_s": 1.0, "duration_s": 2.0}]})
    assert spec.devices == ("A100", "A100", "rtx 6000") and len(spec.slowdowns) == 1
    with pytest.raises(ValueError, match="unknown device 'B200'"):
        spec_from_dict({"workers": [{"device": "B200", "count": 1}]})
    with pytest.raises(ValueError, match="count must be an integer"):
        spec_from_dict({"workers": [{"device": "A100", "count": 0}]})
    with pytest.raises(ValueError, match="out of range"):
        spec_from_dict({"workers": [{"device": "A100"}], "drift": [{"worker": 3}]})
    with pytest.raises(ValueError, match="unknown key"):
        spec_from_dict({"workers": [{"device": "A100", "cnt": 2}]})


def test_proportional_split_respects_caps_and_total() -> None:
    caps = np.array([5, 100, 100])
    split = share_split(60, np.array([10.0, 1.0, 1.0]), caps.tolist(), minimum=1)
    assert sum(split) == 60 and split[0] == 5 and abs(split[1] - split[2]) <= 1
    with pytest.raises(ValueError, match="cannot split"):
        share_split(500, np.ones(3), caps.tolist(), minimum=1)


# --- the oracle's planning against brute force on the ground truth -------------------------

@pytest.mark.parametrize("total", [24, 160])
def test_linearised_plan_matches_brute_force_on_the_truth(total: int) -> None:
    spec = ClusterSpec(devices=("A100", "T4"), bandwidth_gbps=25.0)
    truth = GroundTruth(spec, get_workload("resnet50-imagenet"), QUIET)
    even = np.array([total // 2, total - total // 2])
    _, plan = truth.linearised_plan(lambda c: optimal_split(c, total), even)
    assert sum(plan.local_batches) == total
    best = min(truth.expected_step_time(np.array([b, total - b]))
               for b in range(1, total) if b <= truth.max_local_batch[0]
               and total - b <= truth.max_local_batch[1])
    assert truth.expected_step_time(np.array(plan.local_batches)) <= best * 1.01


# --- policies see measurements only ---------------------------------------------------------

def _reachable(root: object, limit: int = 200_000) -> list[object]:
    seen: set[int] = set()
    stack, out = [root], []
    while stack and len(out) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | type(inspect)):
            continue
        seen.add(id(obj))
        out.append(obj)
        stack.extend(gc.get_referents(obj))
    return out


def test_policies_never_reach_the_ground_truth() -> None:
    truth = GroundTruth(SMALL, short(epochs=0.5))
    ctx = make_context(truth)
    forbidden = (GroundTruth, StepBlock, ClusterSpec, np.random.Generator)
    for name, cls in LEARNING_POLICIES.items():
        assert list(inspect.signature(cls).parameters) == ["ctx"], name
        policy = cls(ctx)
        drive(truth, policy, ctx, SimConfig(seed=3, replan_interval_s=5.0))
        leaks = [type(o).__name__ for o in _reachable(policy) if isinstance(o, forbidden)]
        assert not leaks, f"{name} can reach {leaks}"
    # the walk does find the truth where it is: the oracle holds it
    oracle = make_policy("oracle", ctx, truth)
    assert any(o is truth for o in _reachable(oracle))
    # what policies receive is plain data
    for f in dataclasses.fields(Measurement) + dataclasses.fields(PolicyContext):
        assert f.type in ("tuple[int, ...]", "int", "float", "np.ndarray"), f


# --- the run: progress, determinism ---------------------------------------------------------

def test_ddp_takes_exactly_target_over_batch_steps() -> None:
    wl = short(epochs=1.0)
    truth = GroundTruth(SMALL, wl)
    result = run_policy(truth, "ddp", SimConfig(seed=0))
    assert result.steps == math.ceil(wl.target_samples / wl.init_batch)
    assert result.mean_total_batch == wl.init_batch
    assert result.time_to_target_s == pytest.approx(result.steps * result.mean_step_time_s)


def test_same_seed_same_result_other_seed_differs() -> None:
    cfg = SimConfig(seed=7, replan_interval_s=10.0)
    a = compare(SMALL, short(epochs=1.0), cfg).summary()
    b = compare(SMALL, short(epochs=1.0), cfg, policies=("cannikin", "oracle")).summary()
    c = compare(SMALL, short(epochs=1.0), dataclasses.replace(cfg, seed=8),
                policies=("cannikin",)).summary()
    assert set(a) == {"ddp", "adaptdl", "lb-bsp", "cannikin", "oracle"}
    assert b["cannikin"] == a["cannikin"] and b["oracle"] == a["oracle"]
    assert a["cannikin"]["time_to_target_s"] != c["cannikin"]["time_to_target_s"]
    assert a["oracle"]["ratio_to_oracle"] == 1.0


# --- CLI -------------------------------------------------------------------------------------

def _cli(argv: list[str]) -> int:
    return main(argv)


CLUSTER_TOML = """
[network]
bandwidth_gbps = 25.0
latency_us = 500.0

[[workers]]
device = "A100"
count = 1

[[workers]]
device = "T4"
count = 2
"""


def test_simulate_cli_writes_json_and_plot(tmp_path: Path, capsys) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(CLUSTER_TOML)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = _cli(["simulate", "--cluster", str(cluster), "--workload", "resnet18-cifar10",
               "--target-epochs", "1", "--seed", "1", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    for policy in ("ddp", "adaptdl", "lb-bsp", "cannikin", "oracle"):
        assert {"time_to_target_s", "mean_step_time_s", "mean_total_batch",
                "ratio_to_oracle"} <= set(data[policy])
        assert data[policy]["time_to_target_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "time to target" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--cluster", "nowhere.toml"], "not found"),
    (["simulate", "--workload", "resnet9000"], "unknown workload"),
    (["simulate", "--cluster", "{bad}"], "unknown cluster"),
    (["plan", "--cluster", "paper16", "--batch", "3"], "does not fit"),
    (["simulate", "--policies", "ddp,magic"], "unknown policy 'magic'"),
    (["simulate", "--target-epochs", "0"], "must be > 0"),
])
def test_cli_errors_are_one_line_exit_2(argv: list[str], message: str, capsys) -> None:
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_argparse_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _cli(["plan", "--cluster", "paper16", "--batch", "many"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_rejects_unknown_device_file(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[workers]]\ndevice = "K80"\ncount = 2\n')
    assert _cli(["plan", "--cluster", str(bad), "--batch", "8"]) == 2
    assert "unknown device 'K80'" in capsys.readouterr().err


def test_plan_cli_example_cluster(capsys) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "paper16.toml"
    assert _cli(["plan", "--cluster", str(example), "--batch", "1024"]) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and out.count("A100") >= 4


def test_plan_cli_names_a_worker_that_slows_the_step_at_zero(tmp_path: Path, capsys) -> None:
    # resnet18 on the straggler cluster at B = 64: communication dominates, the two T4s get
    # 0 samples and each still costs its all-reduce share of a ring of 8
    example = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "straggler.toml"
    out_json = tmp_path / "plan.json"
    assert _cli(["plan", "--cluster", str(example), "--batch", "64", "--workload",
                 "resnet18-cifar10", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out_json.read_text())
    costly = payload["costly_workers"]
    assert [w["worker"] for w in costly] == [6, 7]
    assert all(payload["local_batches"][w["worker"]] == 0 for w in costly)
    for w in costly:
        assert f"worker {w['worker']} (T4) gets 0 samples and still costs" in out
        with_it = w["cost_s"] + w["step_time_without_s"]
        assert with_it == pytest.approx(payload["predicted_step_time_s"], rel=1e-12)
        assert w["speedup_without"] == pytest.approx(with_it / w["step_time_without_s"])
        assert w["speedup_without"] >= 1.01


def test_cannikin_matches_adaptdl_when_homogeneous_and_wins_when_not() -> None:
    wl = short("bert-base-squad", epochs=0.5)
    cfg = SimConfig(seed=0)
    homo = compare(ClusterSpec(devices=("V100",) * 4), wl, cfg, ("adaptdl", "cannikin")).summary()
    ratio = homo["cannikin"]["time_to_target_s"] / homo["adaptdl"]["time_to_target_s"]
    assert ratio == pytest.approx(1.0, abs=0.05)
    hetero = compare(SMALL, wl, cfg, ("adaptdl", "cannikin", "oracle")).summary()
    assert hetero["cannikin"]["time_to_target_s"] < 0.8 * hetero["adaptdl"]["time_to_target_s"]
    assert hetero["cannikin"]["ratio_to_oracle"] < 1.15


def test_plan_cli_accumulates_beyond_the_memory_caps(tmp_path: Path, capsys) -> None:
    # bert on paper16 holds 356 samples in one pass; 1024 needs passes, more on the A100s
    example = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "paper16.toml"
    args = ["plan", "--cluster", str(example), "--batch", "1024", "--workload",
            "bert-base-squad"]
    assert _cli(args) == 2
    assert "--max-micro-batches" in capsys.readouterr().err
    out_json = tmp_path / "plan.json"
    assert _cli([*args, "--max-micro-batches", "8", "--json", str(out_json)]) == 0
    payload = json.loads(out_json.read_text())
    truth = GroundTruth(cluster_from_arg(str(example)), get_workload("bert-base-squad"),
                        max_micro_batches=8)
    caps = truth.max_local_batch
    assert sum(payload["local_batches"]) == 1024
    for b, passes, cap in zip(payload["local_batches"], payload["micro_batches"], caps,
                              strict=True):
        assert sum(passes) == b and max(passes) <= cap and len(passes) <= 8
    assert max(len(p) for p in payload["micro_batches"]) > 1
    assert payload["predicted_step_time_s"] == pytest.approx(
        payload["simulated_step_time_s"], rel=0.05)
    assert payload["even_split_step_time_s"] > 1.5 * payload["simulated_step_time_s"]
    assert "passes" in capsys.readouterr().out


def test_ground_truth_passes_before_the_last_run_ahead_of_its_backward() -> None:
    truth = GroundTruth(SMALL, get_workload("resnet50-imagenet"), QUIET, max_micro_batches=4)
    cap = truth.max_local_batch
    split = np.array([2 * cap[0] + 3, 1, 1, 1])  # worker 0: three passes, the larger first
    fwd, bwd = truth.expected_compute(split)
    sizes = [split[0] // 3 + (j < split[0] % 3) for j in range(3)]
    f, k = truth.pass_compute(np.array([[s, 1, 1, 1] for s in sizes], dtype=float))
    assert fwd[0] == pytest.approx(float(f[0, 0] + k[0, 0] + f[1, 0] + k[1, 0] + f[2, 0]))
    assert bwd[0] == pytest.approx(float(k[2, 0]))
    assert (fwd[1], bwd[1]) == pytest.approx((float(f[0, 1]), float(k[0, 1])))
    with pytest.raises(ValueError, match="max_micro_batches"):
        GroundTruth(SMALL, get_workload("resnet50-imagenet"), max_micro_batches=0)


def test_passes_beyond_memory_let_the_batch_grow_past_the_caps() -> None:
    # GPT-small holds 9 samples per V100: 144 on 16 of them, below its best batch
    wl = short("gpt-small-lm", epochs=0.3)  # the noise scale grows: B passes 144 late
    spec = SCENARIOS["homogeneous16"]
    cfg = SimConfig(seed=0)
    one = compare(spec, wl, cfg, ("cannikin", "oracle")).summary()
    more = compare(spec, wl, dataclasses.replace(cfg, max_micro_batches=8),
                   ("cannikin", "oracle")).summary()
    for policy in ("cannikin", "oracle"):
        assert one[policy]["mean_total_batch"] <= 144
        assert more[policy]["mean_total_batch"] > 144
        assert more[policy]["time_to_target_s"] < one[policy]["time_to_target_s"]


def test_measurements_time_the_first_pass_as_the_runtime_does() -> None:
    truth = GroundTruth(SMALL, get_workload("gpt-small-lm"), QUIET, max_micro_batches=4)
    cap = truth.max_local_batch
    split = np.array([3 * cap[0], cap[1], 2, 1])
    block = truth.run_steps(split, 0.0, 3, np.random.default_rng(0))
    assert block.first_batch.tolist() == [cap[0], cap[1], 2, 1]
    f, k = truth.pass_compute(block.first_batch)
    np.testing.assert_allclose(block.first_fwd_s, np.broadcast_to(f, (3, 4)))
    np.testing.assert_allclose(block.first_bwd_s, np.broadcast_to(k, (3, 4)))
    assert block.fwd_s[0, 0] > 2 * (f[0] + k[0])  # two whole passes before the last
