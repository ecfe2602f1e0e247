"""Run policies against the ground truth until the training target is reached.

Training progresses as in Pollux's simulator: each step adds ``B * E(B)`` samples of
progress, ``E`` the true statistical efficiency at the current noise scale, until
``target_epochs * dataset_size`` is reached. Steps run in blocks with one split; after
each block the policy receives a :class:`Measurement` (noisy times and gradient norms)
and decides the next split. Policies never receive the :class:`GroundTruth` object.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cannikin.sim.cluster import ClusterSpec
from cannikin.sim.measure import Measurement, PolicyContext
from cannikin.sim.policies import LEARNING_POLICIES, POLICY_NAMES, Oracle, Policy
from cannikin.sim.profiles import Workload
from cannikin.sim.truth import GroundTruth, NoiseConfig, StepBlock

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """How a simulation is run (same for every policy)."""

    seed: int = 0
    replan_interval_s: float = 30.0
    """Simulated seconds between decisions (blocks are at least `min_block_steps`)."""
    first_block_steps: int = 10
    min_block_steps: int = 5
    max_block_steps: int = 200
    sampled_steps: int = 8
    """Steps per block whose per-phase timings the policy sees (gradient norms: all)."""
    timer_cv: float = 0.01
    """Relative jitter of the profiler's timers on top of the true (noisy) times."""
    ready_jitter: float = 0.02
    """Absolute jitter of measured bucket-ready fractions."""
    max_time_s: float = 30 * 86400.0
    """Give up (time_to_target = None) after this much simulated time."""
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    max_micro_batches: int = 1
    """Passes of at most its memory cap a worker may run per step (gradient accumulation)."""

    def __post_init__(self) -> None:
        if not self.replan_interval_s > 0 or not self.max_time_s > 0:
            raise ValueError("replan_interval_s and max_time_s must be > 0")
        if not 1 <= self.min_block_steps <= self.max_block_steps:
            raise ValueError(f"need 1 <= min_block_steps <= max_block_steps, got "
                             f"{self.min_block_steps}, {self.max_block_steps}")
        if self.first_block_steps < 1 or self.sampled_steps < 1:
            raise ValueError("first_block_steps and sampled_steps must be >= 1")
        if self.max_micro_batches < 1:
            raise ValueError(f"max_micro_batches must be >= 1, got {self.max_micro_batches}")


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One policy's run: summary figures and the per-block history for plots."""

    policy: str
    time_to_target_s: float | None
    elapsed_s: float
    steps: int
    samples: int
    mean_step_time_s: float
    mean_total_batch: float
    history_time_s: np.ndarray
    history_total_batch: np.ndarray
    history_throughput: np.ndarray
    """Samples per second in each block."""
    history_goodput: np.ndarray
    """Progress (efficiency-weighted samples) per second in each block."""
    prediction_error_median: float
    """Median |predicted - measured| / measured of the policy's block mean step time."""


def make_context(truth: GroundTruth) -> PolicyContext:
    w = truth.workload
    return PolicyContext(
        num_workers=truth.num_workers,
        max_local_batch=tuple(int(c) for c in truth.max_local_batch),
        init_batch=w.init_batch,
        max_batch=max(w.max_batch, truth.num_workers),
        max_micro_batches=truth.max_micro_batches,
    )


def make_policy(name: str, ctx: PolicyContext, truth: GroundTruth) -> Policy:
    """A policy by name. Only the oracle is given the truth."""
    if name == Oracle.name:
        return Oracle(ctx, truth)
    if name not in LEARNING_POLICIES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICY_NAMES)}")
    return LEARNING_POLICIES[name](ctx)


def _validate_split(split: Sequence[int], ctx: PolicyContext, policy: str) -> np.ndarray:
    b = np.asarray(split, dtype=np.int64)
    caps = np.array(ctx.max_share)
    if b.shape != (ctx.num_workers,) or (b < 1).any() or (b > caps).any():
        raise ValueError(f"policy {policy!r} returned an invalid split {tuple(split)} for "
                         f"{ctx.num_workers} workers with memory caps {ctx.max_local_batch} "
                         f"and up to {ctx.max_micro_batches} passes")
    return b


def _measure(block: StepBlock, split: np.ndarray, truth: GroundTruth, progress: float,
             elapsed: float, cfg: SimConfig, rng: np.random.Generator,
             gradient_norms: bool) -> Measurement:
    """What the profiler reports: sampled steps' phases (of the first pass, where a worker
    accumulates) and gradient norms, with jitter."""
    steps = len(block.step_s)
    k = min(cfg.sampled_steps, steps)
    idx = np.sort(rng.choice(steps, size=k, replace=False))

    def jitter(a: np.ndarray) -> np.ndarray:
        return a * rng.lognormal(0.0, cfg.timer_cv, a.shape)

    rho = np.clip(truth.ready + rng.normal(0.0, cfg.ready_jitter, (k, len(truth.ready))),
                  0.0, 1.0)
    rho[:, -1] = 1.0
    if gradient_norms:
        local_sq, global_sq = truth.gradient_sqnorms(split, progress, steps, rng)
    else:
        local_sq, global_sq = np.zeros((0, len(split))), np.zeros(0)
    timed = tuple(int(x) for x in block.first_batch)
    local = tuple(int(x) for x in split)
    return Measurement(
        local_batches=local, steps=steps, elapsed_s=elapsed, step_s=jitter(block.step_s),
        fwd_s=jitter(block.first_fwd_s[idx]), bwd_s=jitter(block.first_bwd_s[idx]),
        ready_fractions=rho, allreduce_s=jitter(block.allreduce_s[idx]),
        local_sqnorms=local_sq, global_sqnorm=global_sq,
        timed_batches=() if timed == local else timed,
    )


def run_policy(truth: GroundTruth, name: str, cfg: SimConfig | None = None) -> RunResult:
    """Simulate one policy to the target (or to ``cfg.max_time_s``)."""
    ctx = make_context(truth)
    return drive(truth, make_policy(name, ctx, truth), ctx, cfg)


def drive(truth: GroundTruth, policy: Policy, ctx: PolicyContext,
          cfg: SimConfig | None = None) -> RunResult:
    """Run ``policy`` against ``truth``: it gets a Measurement after each block, nothing else."""
    cfg = cfg or SimConfig()
    name = policy.name
    rng = np.random.default_rng(cfg.seed)
    target = truth.workload.target_samples
    t = progress = 0.0
    steps = samples = 0
    block = cfg.first_block_steps
    hist: list[tuple[float, int, float, float]] = []
    errors: list[float] = []
    while progress < target and t < cfg.max_time_s:
        split = _validate_split(policy.decide(), ctx, name)
        predicted = policy.predicted_step_time()
        total = int(split.sum())
        per_step = total * truth.efficiency(total, progress / target)
        k = min(block, max(math.ceil((target - progress) / per_step), 1))
        result = truth.run_steps(split, t, k, rng)
        duration = float(result.step_s.sum())
        t += duration
        measurement = _measure(result, split, truth, progress / target, t, cfg, rng,
                               policy.needs_gradient_norms)
        progress += k * per_step
        steps += k
        samples += k * total
        hist.append((t, total, k * total / duration, k * per_step / duration))
        if math.isfinite(predicted):
            measured = float(measurement.step_s.mean())
            errors.append(abs(predicted - measured) / measured)
        policy.observe(measurement)
        mean_step = duration / k
        block = int(np.clip(round(cfg.replan_interval_s / mean_step),
                            cfg.min_block_steps, cfg.max_block_steps))
    reached = progress >= target
    if not reached:
        logger.warning("policy %s did not reach the target within %.0f simulated seconds",
                       name, cfg.max_time_s)
    h = np.array(hist, dtype=float).reshape(-1, 4)
    return RunResult(
        policy=name, time_to_target_s=t if reached else None, elapsed_s=t, steps=steps,
        samples=samples, mean_step_time_s=t / max(steps, 1),
        mean_total_batch=samples / max(steps, 1),
        history_time_s=h[:, 0], history_total_batch=h[:, 1], history_throughput=h[:, 2],
        history_goodput=h[:, 3],
        prediction_error_median=float(np.median(errors)) if errors else math.nan,
    )


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """All policies on one cluster and workload, same seed."""

    cluster: ClusterSpec
    workload: Workload
    results: dict[str, RunResult]

    def ratio_to_oracle(self, policy: str) -> float | None:
        mine = self.results[policy].time_to_target_s
        oracle = self.results.get(Oracle.name)
        if mine is None or oracle is None or not oracle.time_to_target_s:
            return None
        return mine / oracle.time_to_target_s

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Per policy: time_to_target_s, mean_step_time_s, mean_total_batch, ratio_to_oracle,
        prediction_error_median (None when nothing was predicted)."""
        return {name: {
            "time_to_target_s": r.time_to_target_s,
            "mean_step_time_s": r.mean_step_time_s,
            "mean_total_batch": r.mean_total_batch,
            "ratio_to_oracle": self.ratio_to_oracle(name),
            "prediction_error_median": (None if math.isnan(r.prediction_error_median)
                                        else r.prediction_error_median),
        } for name, r in self.results.items()}


def compare(spec: ClusterSpec, workload: Workload, cfg: SimConfig | None = None,
            policies: Sequence[str] = POLICY_NAMES) -> Comparison:
    """Run every policy on the same cluster, workload and seed."""
    cfg = cfg or SimConfig()
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known policies: "
                         f"{', '.join(POLICY_NAMES)}")
    truth = GroundTruth(spec, workload, cfg.noise, max_micro_batches=cfg.max_micro_batches)
    results = {}
    for name in policies:
        results[name] = run_policy(truth, name, cfg)
        logger.debug("%s: time to target %s s", name, results[name].time_to_target_s)
    return Comparison(cluster=spec, workload=workload, results=results)
