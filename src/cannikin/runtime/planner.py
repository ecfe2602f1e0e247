"""The planner loop: measurements in, the next step's split (and total batch) out.

Pure numpy on top of :mod:`cannikin.perf`, :mod:`cannikin.optperf`,
:mod:`cannikin.goodput` and :mod:`cannikin.gns`; no torch, so it is tested in one
process. Every rank owns a :class:`Planner` and feeds it the *same* all-gathered
:class:`WorkerReport` of every rank each step, so every rank fits the same models
(DESIGN.md §5); at a re-plan one rank (:attr:`Planner.decider`, the most CPU) chooses
the split and the runtime broadcasts its :class:`~cannikin.runtime.decision.Decision`,
which every rank adopts. The runtime checks that the local batches each rank reports are
the ones every rank planned.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cannikin.gns import NoiseScaleTracker
from cannikin.goodput import choose_batch_size, choose_even_batch_size
from cannikin.losscheck import SummedLossCheck
from cannikin.optperf import (
    CostlyWorker,
    Plan,
    costly_workers,
    optimal_split,
    share_split,
    split_without,
    zero_split,
)
from cannikin.perf import (
    ClusterModel,
    CommFitter,
    CommModel,
    CpuFitter,
    NodeFitter,
    NodeModel,
    PredictionTracker,
    _is_int,
    even_passes,
    fit_nodes,
    micro_batches,
)
from cannikin.rowfit import large_shift, lasting_shift
from cannikin.runtime.decision import Decision

logger = logging.getLogger(__name__)

SPLITS = ("optimal", "even", "adaptdl")
MAX_BUCKETS = 16
"""Buckets kept per step report; more are merged (adjacent, in ready order)."""
MAX_PASSES = 16
"""Most micro-batches per step and worker (:attr:`PlannerConfig.max_micro_batches`): each
one's |g|^2 rides in the step report."""
_PREVIOUS = 13 + 2 * MAX_BUCKETS + MAX_PASSES
"""batch, timed, sqnorm, fwd_s, bwd_s, step_s, buckets, rho.., c.., passes, sqnorm..,
cpu_s, cpu_cores, plan_s, global_sqnorm, output_grad"""
_BEFORE_OUTPUT_GRAD = _PREVIOUS - 1
"""The length of a report saved before the median of its per-sample output gradients."""
_BEFORE_GLOBAL = _BEFORE_OUTPUT_GRAD - 1
"""The length of a report saved before its share of the reduced gradient's |g|^2."""
_BEFORE_PLAN = _BEFORE_GLOBAL - 1
"""The length of a report saved before its re-plan time (a rank checkpoint)."""
_BEFORE_CPU = _BEFORE_PLAN - 2
"""The length of a report saved before its CPU time."""
_BEFORE_PASSES = _BEFORE_CPU - 1 - MAX_PASSES
"""The length of a report saved before the passes' norms."""
REPORT_SIZE = 3 + _PREVIOUS  # batch, oom, has previous, previous
GAP_RATIO = 3.0
"""A step whose period on the clock is over this many times its prediction held more than
the step: the script's own time between two steps that the runtime does not see (a
checkpoint, another model's steps with no forward of this one; an evaluation's forward
marks its step already). The prediction trackers leave it out; a slow step is 1.3-1.6x (the
95th-99th percentile on quota workers)."""
_STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """One rank's measurements of one finished step."""

    batch: int
    """Local batch b_i of the step."""
    sqnorm: float
    """|g_i|^2 of the local mean gradient before the all-reduce (preconditioned)."""
    fwd_s: float
    """F_i: everything outside backward (data, forward, previous optimizer step), of the
    step's first pass where it accumulates."""
    bwd_s: float
    """K_i: backward compute, from its start until the last bucket is ready (the first
    pass's backward where it accumulates)."""
    timed_batch: int | None = None
    """Samples of the pass ``fwd_s`` and ``bwd_s`` time: the first micro-batch's where the
    step accumulates, None for ``batch`` (one pass)."""
    pass_sqnorms: tuple[float, ...] = ()
    """|g|^2 of each micro-batch's own mean gradient where the step took several and
    measured norms (the noise scale's gradient groups); () otherwise."""
    step_s: float
    """Measured period of the whole step on this rank, from the end of the re-plan that
    began it, if one did (:attr:`plan_s`)."""
    ready_fractions: tuple[float, ...] = ()
    """Per bucket, in ready order: fraction of this rank's backward done when it was ready."""
    allreduce_s: tuple[float, ...] = ()
    """Per bucket: this rank's view of the all-reduce time (includes waiting for peers)."""
    cpu_s: float = 0.0
    """CPU seconds of the whole process over the step (every thread; 0: not measured)."""
    cpu_cores: float = 0.0
    """Cores the process may use (:func:`~cannikin.runtime.quota.own_cpu_limit`; 0: not
    known). ``cpu_s / cpu_cores`` is the shortest the step could have been."""
    plan_s: float = 0.0
    """Wall seconds this rank spent re-planning between the previous step and this one (0:
    no re-plan). Every rank re-plans there, and the others wait in this step's all-reduce
    for the slowest: on a worker held to a quarter of a core a re-plan took ~20 ms."""
    global_sqnorm: float | None = None
    """|g|^2 of the step's all-reduced gradient (the noise scale's space) as this rank took
    it: the whole on the rank with the step's largest local batch, 0 on the others, None
    where the step's norms were not taken. The ranks' reports sum to it."""
    output_grad: float = 0.0
    """The median over this rank's samples of the norm of their loss's gradient at the
    model's output, those not 0 (:mod:`cannikin.losscheck`); 0 where not taken: a step
    without norms, of several passes, or whose output has no row per sample."""

    def to_vector(self) -> list[float]:
        ready, comm = merge_buckets(self.ready_fractions, self.allreduce_s, MAX_BUCKETS)
        pad = [0.0] * (MAX_BUCKETS - len(ready))
        if len(self.pass_sqnorms) > MAX_PASSES:
            raise ValueError(f"{len(self.pass_sqnorms)} passes' norms; at most {MAX_PASSES}")
        passes = [0.0] * (MAX_PASSES - len(self.pass_sqnorms))
        return [float(self.batch), float(self.timed), self.sqnorm, self.fwd_s, self.bwd_s,
                self.step_s, float(len(ready)), *ready, *pad, *comm, *pad,
                float(len(self.pass_sqnorms)), *self.pass_sqnorms, *passes, self.cpu_s,
                self.cpu_cores, self.plan_s,
                math.nan if self.global_sqnorm is None else self.global_sqnorm,
                self.output_grad]

    @property
    def timed(self) -> int:
        """The samples ``fwd_s`` and ``bwd_s`` are of (see :attr:`timed_batch`)."""
        return self.batch if self.timed_batch is None else self.timed_batch

    @staticmethod
    def from_vector(values: Sequence[float]) -> StepReport:
        if len(values) == _BEFORE_PASSES - 1:  # saved before timed_batch
            values = [values[0], values[0], *values[1:]]
        if len(values) == _BEFORE_PASSES:  # saved before the passes' norms
            values = [*values, *[0.0] * (1 + MAX_PASSES)]
        if len(values) == _BEFORE_CPU:  # saved before the CPU time
            values = [*values, 0.0, 0.0]
        if len(values) == _BEFORE_PLAN:  # saved before the re-plan time
            values = [*values, 0.0]
        if len(values) == _BEFORE_GLOBAL:  # saved before the share of |g|^2
            values = [*values, math.nan]
        if len(values) == _BEFORE_OUTPUT_GRAD:  # saved before the output gradients' median
            values = [*values, 0.0]
        if len(values) != _PREVIOUS:
            raise ValueError(f"a step report has {_PREVIOUS} values, got {len(values)}")
        m = int(values[6])
        global_sqnorm = float(values[_BEFORE_GLOBAL])
        batch, timed = int(values[0]), int(values[1])
        return StepReport(batch=batch, timed_batch=None if timed == batch else timed,
                          sqnorm=float(values[2]), fwd_s=float(values[3]),
                          bwd_s=float(values[4]), step_s=float(values[5]),
                          ready_fractions=tuple(float(v) for v in values[7:7 + m]),
                          allreduce_s=tuple(float(v) for v in
                                            values[7 + MAX_BUCKETS:7 + MAX_BUCKETS + m]),
                          pass_sqnorms=tuple(float(v) for v in values[
                              _BEFORE_PASSES + 1:_BEFORE_PASSES + 1
                              + int(values[_BEFORE_PASSES])]),
                          cpu_s=float(values[_BEFORE_CPU]),
                          cpu_cores=float(values[_BEFORE_CPU + 1]),
                          plan_s=float(values[_BEFORE_PLAN]),
                          global_sqnorm=None if math.isnan(global_sqnorm) else global_sqnorm,
                          output_grad=float(values[_BEFORE_OUTPUT_GRAD]))


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """What one rank contributes to the per-step exchange (one row of it).

    The exchange is built at the end of the forward pass and travels with a gradient
    bucket's all-reduce, so it costs the step almost nothing; the previous step's
    measurements (gradient norm, timings) are what it can carry then, so the planner
    and the noise scale see every step one step late.
    """

    batch: int
    """Local batch b_i of this step (checked against every rank's plan)."""
    oom: bool = False
    """This step ran out of memory on this rank."""
    previous: StepReport | None = None
    """The previous step's measurements (None on the first step and after a skipped one)."""

    def to_vector(self) -> list[float]:
        """Fixed-length float encoding (:data:`REPORT_SIZE`)."""
        prev = self.previous.to_vector() if self.previous is not None else [0.0] * _PREVIOUS
        return [float(self.batch), float(self.oom), float(self.previous is not None), *prev]

    @staticmethod
    def from_vector(values: Sequence[float]) -> WorkerReport:
        if len(values) != REPORT_SIZE:
            raise ValueError(f"a worker report has {REPORT_SIZE} values, got {len(values)}")
        return WorkerReport(batch=int(values[0]), oom=bool(values[1]),
                            previous=StepReport.from_vector(values[3:]) if values[2] else None)


def merge_buckets(ready: Sequence[float], allreduce: Sequence[float],
                  max_buckets: int) -> tuple[list[float], list[float]]:
    """At most ``max_buckets`` groups of adjacent buckets: last ready fraction, summed time."""
    if len(ready) != len(allreduce):
        raise ValueError(f"{len(ready)} ready fractions but {len(allreduce)} all-reduce times")
    n = len(ready)
    if n <= max_buckets:
        return list(ready), list(allreduce)
    edges = np.linspace(0, n, max_buckets + 1).round().astype(int)
    return ([float(ready[b - 1]) for b in edges[1:]],
            [float(sum(allreduce[a:b])) for a, b in zip(edges[:-1], edges[1:], strict=True)])


def _median(values: Sequence[float]) -> float:
    """np.median of a few floats (NaN if any is NaN) without numpy's per-call overhead:
    the planner takes several medians of one value per rank every step."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return float(statistics.median(values))


def _minimum(values: Sequence[float]) -> float:
    """np.min of a few floats (NaN if any is NaN), for the per-step path."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return float(min(values))


def _noise_sd(values: Sequence[float]) -> float:
    """Robust standard deviation of the noise in a series whose level may shift (a re-fit
    model, a real speed change): from the MAD of successive differences, which a shift
    touches once. 0.0 until there are 12 values (too few to tell)."""
    if len(values) < 12:
        return 0.0
    diffs = np.diff(np.asarray(values, dtype=np.float64))
    mad = float(np.median(np.abs(diffs - np.median(diffs))))
    return 1.4826 * mad / math.sqrt(2.0)


@dataclass(kw_only=True)
class PlannerConfig:
    """How the planner plans; identical on every rank."""

    world_size: int
    """Number of workers."""
    init_batch: int
    """B0: the total batch to start with (and keep, unless ``max_batch`` is set)."""
    split: str = "optimal"
    """"optimal" (OptPerf); "even", the DDP baseline (a fixed total batch, split evenly, the
    same measurements); or "adaptdl", AdaptDL's policy as a baseline (the total batch chosen
    by goodput on the even split's step times, :func:`~cannikin.goodput.
    choose_even_batch_size`, and split evenly; it needs ``max_batch``)."""
    replan_every: int = 5
    """K: re-plan after every K steps once warm."""
    max_replan_every: int = 40
    """While the plan stays the same the interval doubles, up to this many steps."""
    warmup_steps: int = 5
    """Steps on the even split before the first plan: the last ``warmup_steps -
    skip_steps`` are measured, and three are what makes a level of a worker's CPU
    (:class:`~cannikin.perf.CpuFitter`), the one measurement of the even split."""
    skip_steps: int = 2
    """First steps whose timings are not fitted: DDP rebuilds its buckets in the second,
    and caches and allocators are cold in both. On 100/50/25% CPU-quota workers (3 ranks,
    160 samples each) the CPU per step of the first three was 27-30, 25-28 and 20-25 ms,
    and 20.9-23.8 (once 26.0) at the even split held after; with only the first skipped,
    the warm-up's level of the even split read high on the quarter-core worker (24.9 ms
    there, and 27.0 in a run of ``bench_real`` against 21.5-22.9 later in the run)."""
    max_batch: int | None = None
    """Adaptive total batch up to this (goodput); None keeps B0."""
    min_local: int = 1
    """Smallest local batch a worker is planned (``local_bsz_bounds[0]``), unless it gets
    none (``allow_zero``)."""
    min_pass: int = 1
    """Fewest samples in one pass (a forward) of a worker that has any: 2 for a model with
    BatchNorm layers, whose training forward refuses a single value per channel (a worker
    planned 1 sample ended the job; DDP's equal batches never give one). ``min_local`` is
    raised to it times the passes of :attr:`micro_batches`, and a final partial batch too
    small for every worker goes to the fastest, at least this many each."""
    allow_zero: bool = True
    """A worker may be planned 0 samples when the step is faster so (it still joins the
    all-reduce and the update; its gradient weight is 0): on real 100/50/25% CPU workers
    the best split gave the slowest worker none (:func:`~cannikin.optperf.zero_split`)."""
    max_local: int | None = None
    """Largest local batch for every worker (``local_bsz_bounds[1]``)."""
    caps: tuple[int | None, ...] = ()
    """Per-worker largest local batch (memory); () for none. With :attr:`accumulate`, the
    largest micro-batch: one forward and backward."""
    accumulate: bool = False
    """A worker's local batch may exceed its cap, in up to :attr:`max_micro_batches`
    passes of at most the cap each (:func:`~cannikin.perf.micro_batches`), gradients
    accumulated and all-reduced after the last; planned where it pays (a total beyond the
    caps, or a faster step)."""
    max_micro_batches: int = 8
    """Most passes a step of one worker takes when accumulating."""
    micro_batches: int | None = None
    """Every step of every worker in exactly this many passes (:func:`~cannikin.perf.
    even_passes`), each at most its cap, instead of as few as the caps allow: for a loop
    that counts batches, not samples, as Lightning's ``accumulate_grad_batches`` (every
    rank runs the user's training step, and the collectives in it, that many times per
    optimizer step, and steps after the last). A worker then gets 0 samples or at least
    one per pass (``min_local`` is raised to it); above 1 it sets :attr:`accumulate`
    (with ``max_micro_batches`` 1: the other rule, which it excludes)."""
    names: tuple[str, ...] = ()
    """Per-worker device name, the key of cached models; () for "worker<i>"."""
    gns_smoothing: float = 0.999
    """Smoothing of the noise-scale average per step of ``init_batch`` samples (a step of B
    samples counts as B / init_batch of them, AdaptDL's 0.999^(B/B0);
    :class:`~cannikin.gns.NoiseScaleTracker`). A per-step 0.9 (a ~10-step window) let the
    smoothed |G|^2 fall to <= 0 in 10-16% of steps when the noise scale is far above B;
    the noise scale was then capped at 1e12 and the batch sent to its maximum, half the
    true goodput (``tests/test_planner_adaptive.py``)."""
    gns_sigmas: float = 2.0
    """The batch is chosen by a cautious noise scale: tr(Sigma) over |G|^2 plus this many of
    its standard errors (:attr:`~cannikin.gns.NoiseScaleTracker.grad_sqr_error`), so it
    grows as the evidence does. Early in a run far above B a |G|^2 estimated at 0.19
    (true 1) sent the batch to its maximum."""
    gns_replan: float | None = 0.1
    """With the total batch chosen by goodput (:attr:`max_batch`), a re-plan comes before
    its turn once the cautious noise scale has moved by more than this fraction (either
    way) from the one the batch was chosen with; no sooner than :attr:`replan_every` steps
    (and the re-plans' own budget, :attr:`plan_budget`) after the last, and not during a
    probe or a trial. A plan that holds is re-checked only every :attr:`max_replan_every`
    steps, which the noise scale does not wait for: with |G|^2 falling 50x while a plan
    held, the batch grew 8-12 steps sooner (``tests/test_planner_adaptive.py``), with no
    more re-plans while the noise scale stayed. None: the cadence alone."""
    probe_error: float | None = 0.15
    """Once a plan holds, a worker whose measurements pin its time per sample down only to
    worse than this relative standard error (:meth:`NodeFitter.slope_error`), or whose
    measured CPU makes no floor yet (:attr:`cpu_floor`: its batch sizes too close), is
    planned a different batch for one re-plan interval (a probe: the even share, or twice
    or half its batch when that is close), the others split optimally around it. A held
    plan spans a few batch sizes, and the warm-up's even split is then a few noisy samples:
    on 100/50/25% workers the model predicted the even split 13x too slow. None: none of
    these probes (:attr:`refresh_after` has its own)."""
    probe_every: int = 100
    """Steps from one probe to the next, at least (a probe's steps are slower)."""
    probe_budget: float = 0.02
    """A probe waits until its predicted extra time (its steps' over the held plan's) is
    at most this fraction of the predicted time since the probe before it (or the start).
    On 100/50/25% CPU-quota workers a probe of the quarter-core worker at its even share
    doubled the step for 5 steps every 100-140 steps: 4-5% of the run, and the gap between
    Cannikin and plain DDP at its split in the benchmarks that caught one."""
    refresh_after: int | None = 500
    """A worker planned under half its even share is probed at that share (as a probe
    above, within :attr:`probe_budget`) once its latest measured step at half of it or
    more is this many steps old, however well its fit looks. Nothing else measures it at
    work: a worker held at 0 samples that became faster stayed there for good (a warm-up
    that read it slow was never corrected either). In ``tests/test_planner_model.py`` a
    quarter-speed worker at 0 that became as fast as the others at step 100 was probed
    at steps 516-539 and then planned its share: the last 300 steps ran 1.004-1.016x the
    optimum, against 1.28-1.29x without. The budget sets the pace for a worker predicted
    far slower at its share. None: no refresh."""
    probe_snap: float = 0.1
    """A probe goes to a batch size measured before when one is within this fraction of its
    target, so that repeated probes fill one batch size's measurements (and then stop)."""
    trial_margin: float = 0.1
    """A worker the plan gives the fewest samples is tried at 0 (the others split optimally)
    for :attr:`trial_steps` steps when the model predicts that step at most this fraction
    slower, and kept there for :attr:`trial_every` steps if the *measured* step was faster
    by more than :attr:`trial_gain`. The model holds the all-reduce fixed; on real
    100/50/25% CPU-quota workers it is not: at 37 samples the slowest worker's CPU was
    saturated and its throttled share of the all-reduce slowed everyone, so the step was
    20% faster with it at 0, which the model predicted 4% slower. 0: no trials."""
    trial_share: float = 0.25
    """Only a worker planned at most this fraction of the even share is tried: the trial
    is for a worker whose few samples may cost more than the model knows, and a trial of a
    busy one would cost the others' balance. Where a step with an idle worker has an
    all-reduce of its own (:attr:`idle_route`) and none has been measured yet, the
    least-loaded worker is tried whatever its share: the model cannot know that step
    until it is measured (on 100/50/25% quota workers Cannikin held the quarter-core
    worker at 43 samples, 27% of its even share, 1.23x the best split, which gave it 0)."""
    trial_steps: int = 10
    """Steps a trial lasts (its median step against the last as many of the split before)."""
    trial_gain: float = 0.05
    """How much faster the trial's median step must be to keep the worker at 0."""
    trial_every: int = 200
    """Steps from one trial of a worker to the next, and how long a kept one stays at 0."""
    cpu_floor: bool = True
    """Fit each worker's CPU seconds per step (every thread) as a line in its local batch,
    and plan with it over the cores it may use as a floor under its step
    (:attr:`~cannikin.perf.NodeModel.cpu_floor`). On 100/50/25% CPU-quota workers the
    step was the quarter-core worker's CPU over its share within 1-5% wherever it had
    samples (and that worker set it at the even split, where the compute model alone
    predicted it 20% short); a GPU worker's CPU is rarely near its cores, and then the
    floor never binds."""
    idle_route: bool = False
    """A step that gives some worker 0 samples reduces the gradient over the busy workers
    only (:mod:`cannikin.runtime.routes`, a CPU-only job's): its all-reduce is fitted apart
    from the others' (:attr:`~cannikin.perf.ClusterModel.idle_comm`). On 100/50/25% quota
    workers it took half the wall time of the three-way ring (8.9 against 18.1 ms for the
    MLP of ``bench_real``), and one model of both kept the quarter-core worker at 27-45
    samples where 0 was 1.3x faster."""
    costly_speedup: float = 1.01
    """A worker planned 0 samples is reported (logged once, ``PlanRecord.costly``) when the
    step is predicted at least this many times faster without it."""
    hold_sigmas: float = 0.5
    """A re-plan keeps the split in force unless the new one is predicted faster by more
    than this many standard errors of a worker's mean time (its fitted relative noise over
    the square root of its window's samples), or by more than :attr:`plan_hold` where
    that is larger. A gain within the model's own uncertainty is no gain: on real quota
    workers (step noise ~25%) the split moved by a few samples at every re-plan, so the
    cadence never lengthened, every step was measured, and the slowest worker refitted
    every 5 steps (~17 ms of CPU each)."""
    plan_hold: float = 0.003
    """The floor of that tolerance, as a fraction of the new optimum: even exact models move
    the optimum by a sample now and then, and each move would reset the cadence and the
    measuring (:attr:`measure_stride`) for nothing."""
    plan_budget: float | None = 0.03
    """The share of the step time that re-planning may take: after a re-plan the next one
    comes no sooner than its measured time (the slowest rank's :attr:`StepReport.plan_s`,
    the median of the last few) over this share of the predicted step, up to half of
    :attr:`max_replan_every` (a plan is held, and measured every :attr:`measure_stride`-th
    step, only once it held at the longest interval). A re-plan's fit costs every rank a
    few ms of CPU, its choice the deciding rank (:attr:`Planner.decider`) ~6 ms more, and
    every rank waits for both: 17-19 ms on quota workers 1/0.5/0.25 against steps of
    ~50 ms (31-61 ms when every rank chose for itself). Probes and trials keep their own
    lengths. None: the cadence alone."""
    measure_stride: int = 4
    """Once a plan has held until the re-plan cadence reached its longest interval, only
    every measure_stride-th step is measured (timings and gradient norms, DESIGN.md §5);
    the others cost what plain DDP costs. A change of plan brings back measuring every
    step (a probe's and a trial's too), but a re-balance on the cadence of a plan measured
    at this stride, with the same workers busy (the one a probe or trial interrupted, on
    its return): the model knows the workers there, and measuring every step at Cannikin's
    split on quota workers 1/0.5/0.25 took 1.064x the wall time of this stride (the idle
    worker's CPU per step sets the step there), for ~75 steps after each such move, several
    times a run. A drift's re-plan, a change of the total batch or of the busy workers
    measures every step."""
    max_measure_stride: int = 16
    """The stride doubles every ``2 * max_replan_every`` steps that the plan holds with
    nothing but re-plans on the cadence that keep it (a probe or trial that returns to it
    does not count against it), up to this; any other re-plan starts it again at
    :attr:`measure_stride`. A measured step and the step that carries its exchange each
    cost the quarter-core worker of ``bench_real`` ~2 ms more CPU than a hook-free one at
    the even split (+8-9% wall time for that step), and at a stride of 4 they were half
    the steps. The price is a slower look at a change of speed: :attr:`drift_steps`
    measured steps take 4x as many steps at 16, so the re-plans on the cadence come
    first (in ``tests/test_runtime_planner.py`` a worker 3x slower was followed by the
    second, 49 steps after). The total batch chosen by goodput
    (:attr:`max_batch`) keeps :attr:`measure_stride`: its noise scale is measured on
    these steps."""
    drift_steps: int = 6
    """A worker whose compute time is off its model by more than :attr:`drift_change` in
    the median of this many consecutive steps triggers a re-plan at once (single
    stragglers do not), provided the shift is also :attr:`drift_sigmas` standard errors of
    that median: :func:`cannikin.rowfit.lasting_shift`, the rule of the fitter's
    change-point test too (:class:`~cannikin.perf.FitConfig`), which then decides at the
    re-plan which samples to forget. The two ask different questions and keep their own
    statistics and constants: this one whether the latest steps left the model *in force*
    (a median against 0, once per step, with the noise of successive differences over
    re-fits), the fitter's where in its window the speed changed (the largest of ~57
    two-sample z statistics). The fitter's test in place of this one was tried and
    reverted: it re-planned spuriously on CPU-quota workers."""
    drift_change: float = 0.3
    """Relative shift of that median that counts as drift: twice the fitter's
    ``drift_min_change``, since a re-plan out of turn costs a refit and resets the cadence,
    worth it only for a change that moves the split."""
    drift_sigmas: float = 3.0
    """Standard errors of that median the shift must also exceed. Lower than the fitter's
    ``drift_sigmas`` (5): one median is tested, not a maximum over splits. With log-noise
    0.25-0.5 (5% 10x stragglers) 3 gives ~3 false re-plans per 1000 steps and sees a 2x
    change after a median of 4-10 steps; 5 would take 6.5-42 (simulated rule)."""
    drift_noise_history: int = 32
    """Per worker, this many last log(measured / predicted) values estimate the timing noise
    for that standard error. On a busy shared CPU the noise reaches ~0.5 in log terms, and
    a 30% rule alone then re-plans every few steps on noise."""
    oom_cap_factor: float = 0.8
    """After an out-of-memory at local batch b, that worker's cap becomes
    floor(oom_cap_factor * b) (and at most b - 1)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.init_batch < 1:
            raise ValueError(f"init_batch (batch_size) must be >= 1, got {self.init_batch}")
        if self.replan_every < 1:
            raise ValueError(f"replan_every must be >= 1, got {self.replan_every}")
        self.max_replan_every = max(self.max_replan_every, self.replan_every)
        if self.warmup_steps < 1 or self.skip_steps < 0 or self.skip_steps >= self.warmup_steps:
            raise ValueError(f"need 0 <= skip_steps ({self.skip_steps}) < warmup_steps "
                             f"({self.warmup_steps})")
        if self.split == "even" and self.max_batch is not None:
            raise ValueError("split='even' is the DDP baseline, with a fixed total batch: "
                             "for a goodput-chosen batch on the even split (AdaptDL's "
                             "policy) use split='adaptdl'")
        if self.split == "adaptdl" and self.max_batch is None:
            raise ValueError("split='adaptdl' chooses the total batch by goodput: set a "
                             "max_batch_size (loader.autoscale_batch_size), or use "
                             "split='even' for a fixed one")
        if self.max_batch is not None and self.max_batch < self.init_batch:
            raise ValueError(f"max_batch_size {self.max_batch} is below batch_size "
                             f"{self.init_batch}")
        if not _is_int(self.min_pass) or self.min_pass < 1:
            raise ValueError(f"min_pass must be an integer >= 1, got {self.min_pass!r}")
        if self.min_pass > 1:  # a lo of 0 lets optimal_split plan any batch, 1 included
            self.min_local = max(self.min_local, self.min_pass)
        if self.min_local < 0 or (self.max_local is not None and self.max_local < self.min_local):
            raise ValueError(f"local_bsz_bounds ({self.min_local}, {self.max_local}) must "
                             "satisfy 0 <= lo <= hi")
        if not self.caps:
            self.caps = (None,) * self.world_size
        if not self.names:
            self.names = tuple(f"worker{i}" for i in range(self.world_size))
        if len(self.caps) != self.world_size or len(self.names) != self.world_size:
            raise ValueError(f"caps {self.caps} and names {self.names} need one entry per "
                             f"worker ({self.world_size})")
        self._check_micro_batches()
        for cap in self.caps:
            if cap is not None and cap * (self.micro_batches or 1) < max(self.min_local, 1):
                raise ValueError(f"local batch cap {cap} is below the smallest local batch "
                                 f"{max(self.min_local, 1)}")
        room = [self.cap_of(i) for i in range(self.world_size)]
        if None not in room and sum(r for r in room if r is not None) < self.init_batch:
            raise ValueError(f"batch_size {self.init_batch} does not fit the local caps {room}")
        if not (math.isfinite(self.hold_sigmas) and self.hold_sigmas >= 0):
            raise ValueError(f"hold_sigmas must be finite and >= 0, got {self.hold_sigmas}")
        if self.probe_error is not None and not self.probe_error > 0:
            raise ValueError(f"probe_error must be > 0 or None, got {self.probe_error}")
        if not self.probe_budget > 0:
            raise ValueError(f"probe_budget must be > 0, got {self.probe_budget}")
        if not (self.trial_margin >= 0 and 0 <= self.trial_gain < 1
                and 0 < self.trial_share <= 1):
            raise ValueError(f"trial_margin ({self.trial_margin}) must be >= 0, trial_gain "
                             f"({self.trial_gain}) in [0, 1) and trial_share "
                             f"({self.trial_share}) in (0, 1]")
        if self.trial_steps < 3 or self.trial_every < self.trial_steps:
            raise ValueError(f"need 3 <= trial_steps ({self.trial_steps}) <= trial_every "
                             f"({self.trial_every})")
        if not self.costly_speedup >= 1.0:
            raise ValueError(f"costly_speedup must be >= 1, got {self.costly_speedup}")
        if not 0 <= self.probe_snap < 1:
            raise ValueError(f"probe_snap must be in [0, 1), got {self.probe_snap}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.refresh_after is not None and self.refresh_after < 1:
            raise ValueError(f"refresh_after must be None or >= 1, got {self.refresh_after}")
        if not (0 <= self.plan_hold < 1 and 0 < self.oom_cap_factor < 1):
            raise ValueError(f"plan_hold ({self.plan_hold}) and oom_cap_factor "
                             f"({self.oom_cap_factor}) must be in [0, 1) and (0, 1)")
        if self.gns_replan is not None and not self.gns_replan > 0:
            raise ValueError(f"gns_replan must be None or > 0, got {self.gns_replan}")
        if self.plan_budget is not None and not 0 < self.plan_budget < 1:
            raise ValueError(f"plan_budget must be None or in (0, 1), got {self.plan_budget}")
        for name in ("measure_stride", "drift_steps", "drift_noise_history"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_measure_stride < self.measure_stride:
            raise ValueError(f"max_measure_stride ({self.max_measure_stride}) must be >= "
                             f"measure_stride ({self.measure_stride})")
        if not 1 <= self.max_micro_batches <= MAX_PASSES:
            raise ValueError(f"max_micro_batches must be in [1, {MAX_PASSES}], got "
                             f"{self.max_micro_batches}")
        if not (self.drift_change > 0 and self.drift_sigmas >= 0):
            raise ValueError(f"drift_change ({self.drift_change}) must be > 0 and "
                             f"drift_sigmas ({self.drift_sigmas}) >= 0")
        if self.min_local * self.world_size > self.init_batch:
            raised = f" (raised to min_pass={self.min_pass})" if self.min_pass > 1 else ""
            raise ValueError(f"local_bsz_bounds lo={self.min_local}{raised} times "
                             f"{self.world_size} workers exceeds batch_size {self.init_batch}")

    def _check_micro_batches(self) -> None:
        """Validate :attr:`micro_batches` and apply what it implies (before the caps are
        checked, which it multiplies)."""
        passes = self.micro_batches
        if passes is None:
            return
        if isinstance(passes, bool) or not isinstance(passes, int) or not (
                1 <= passes <= MAX_PASSES):
            raise ValueError(f"micro_batches must be None or an integer in [1, {MAX_PASSES}], "
                             f"got {passes!r}")
        if self.accumulate and self.max_micro_batches > 1:
            raise ValueError(f"micro_batches={passes} (every step in that many passes) and "
                             f"max_micro_batches={self.max_micro_batches} (as few as the caps "
                             f"allow, up to that many) are two rules: give one")
        least = self.least_busy
        if least * self.world_size > self.init_batch:
            raise ValueError(f"micro_batches={passes} needs {self.min_pass} sample(s) per pass "
                             f"on each of the {self.world_size} workers: batch_size must be >= "
                             f"{least * self.world_size}, got {self.init_batch}")
        if self.max_local is not None and self.max_local < least:
            raise ValueError(f"micro_batches={passes} needs {self.min_pass} sample(s) per pass: "
                             f"local_bsz_bounds hi={self.max_local} must be >= {least}")
        self.min_local = max(self.min_local, least)
        self.accumulate, self.max_micro_batches = passes > 1, 1

    @property
    def least_busy(self) -> int:
        """Fewest samples of a worker that has any: ``min_pass`` in each of its
        :attr:`micro_batches` passes."""
        return (self.micro_batches or 1) * self.min_pass

    def cap_of(self, rank: int) -> int | None:
        """Worker ``rank``'s largest local batch (its memory cap, times the passes it may
        accumulate, and the upper bound together)."""
        cap = self.caps[rank]
        if cap is not None and self.micro_batches is not None:
            cap *= self.micro_batches
        elif cap is not None and self.accumulate:
            cap *= self.max_micro_batches
        caps = [c for c in (cap, self.max_local) if c is not None]
        return min(caps) if caps else None

    def micro_cap(self, rank: int) -> int | None:
        """Worker ``rank``'s largest pass where it may accumulate beyond it, else None."""
        cap = self.caps[rank]
        bound = self.cap_of(rank)
        if (not self.accumulate or self.micro_batches is not None or cap is None
                or bound is None or bound <= cap):
            return None
        return cap


@dataclass(frozen=True, kw_only=True)
class PlanRecord:
    """A plan as logged and exposed: when, why, what, and the models behind it."""

    step: int
    reason: str
    total_batch: int
    local_batches: tuple[int, ...]
    predicted_step_s: float | None
    nodes: tuple[NodeModel, ...] | None = None
    comm: CommModel | None = None
    noise_scale: float | None = None
    costly: tuple[CostlyWorker, ...] = ()
    """Workers planned 0 samples that still slow the step (their fixed time or all-reduce
    share), with the predicted step time without each (:func:`~cannikin.optperf.costly_workers`)."""

    @property
    def exploring(self) -> bool:
        """A probe's or a trial's split: planned to learn, not for speed."""
        return self.reason.startswith(("probe", "try"))


@dataclass
class Planner:
    """Fits the cluster from step reports and re-plans on a cadence; same on every rank."""

    config: PlannerConfig
    log_plans: bool = True
    """Log each plan and the fitted models at INFO (the runtime sets it on rank 0 only)."""
    fitters: list[NodeFitter] = field(init=False)
    cpu_fitters: list[CpuFitter] = field(init=False)
    """Each worker's CPU seconds per step against its whole local batch (0 included)."""
    cpu_cores: list[float] = field(init=False)
    """The cores each worker last reported it may use (0: not known)."""
    comm_fitter: CommFitter = field(init=False)
    idle_comm_fitter: CommFitter = field(init=False)
    """The all-reduce of the steps with a worker at 0 (:attr:`PlannerConfig.idle_route`)."""
    tracker: PredictionTracker = field(init=False)
    """How well the model predicts each step once there is a model (none predicts the
    warm-up's even split), by this rank's clock (:meth:`time_step`): the one state of a
    planner that differs from rank to rank, a record, never read by a plan."""
    loss_check: SummedLossCheck = field(default_factory=SummedLossCheck, init=False)
    """Whether the workers' loss looks summed over their local batch (logged once)."""
    chosen_tracker: PredictionTracker = field(init=False)
    """The same over the splits the planner chose for speed: :attr:`tracker`'s windows but
    those of a probe, a trial at 0 samples and a pinned split (each made to learn, or held
    from outside). The prediction error at the optimal split is this one's."""
    noise: NoiseScaleTracker = field(init=False)
    cluster_model: ClusterModel | None = field(default=None, init=False)
    current: PlanRecord = field(init=False)
    history: list[PlanRecord] = field(default_factory=list, init=False)
    cached: dict[str, NodeModel] = field(default_factory=dict, init=False)
    _interval: int = field(default=0, init=False)  # steps from one re-plan to the next
    _next_replan: int = field(default=0, init=False)
    _drift_ratios: list[list[float]] = field(default_factory=list, init=False)
    _drift_history: list[list[float]] = field(default_factory=list, init=False)
    _drifted: int | None = field(default=None, init=False)  # a worker off its model
    _chosen_noise: float | None = field(default=None, init=False)
    """The cautious noise scale at the last re-plan (None: none yet)."""
    _noise_moved: str | None = field(default=None, init=False)
    """Why the noise scale asks for a re-plan (:attr:`PlannerConfig.gns_replan`), or None."""
    _earliest_replan: int = field(default=0, init=False)
    """The first step after which a re-plan for the noise scale may come."""
    _prediction: tuple[ClusterModel, tuple[int, ...], float] | None = field(
        default=None, init=False)  # the last predicted() of the model in force, reused
    _costly_said: set[int] = field(default_factory=set, init=False)  # logged once each
    _last_probe: int | None = field(default=None, init=False)  # step of the latest probe
    _before_probe: tuple[tuple[int, ...], int] | None = field(default=None, init=False)
    """The split a probe interrupted and the re-plan interval it had reached."""
    _last_busy: list[int] = field(init=False)
    """Each worker's latest measured step at half its even share or more (0 before any)."""
    _measured: deque[tuple[tuple[int, ...], float]] = field(
        default_factory=lambda: deque(maxlen=64), init=False)
    """The last measured steps: (split, step seconds as the median over ranks)."""
    _plan_stalls: deque[float] = field(default_factory=lambda: deque(maxlen=5), init=False)
    """The slowest rank's wall time of each of the last re-plans (:attr:`StepReport.plan_s`)."""
    _trial: tuple[int, tuple[int, ...], tuple[int, ...]] | None = field(default=None,
                                                                        init=False)
    """The trial in force: (rank tried at 0, the trial's split, the split before it)."""
    _idle_until: dict[int, int] = field(default_factory=dict, init=False)
    """Workers kept at 0 samples by a trial, and the step until which they stay there."""
    _last_trial: dict[int, int] = field(default_factory=dict, init=False)
    """The step of each worker's latest trial."""
    pinned: bool = field(default=False, init=False)
    """A split set from outside holds (:meth:`pin`): no re-plan until it is released."""
    _every_step: bool = field(default=True, init=False)
    """The chosen plan in force is measured every step until it holds; False: at the
    stride from the start (a re-balance, :attr:`PlannerConfig.measure_stride`)."""
    _held_since: int | None = field(default=None, init=False)
    """The step from which the held plan's stride grows (:attr:`PlannerConfig.
    max_measure_stride`); None while no plan holds."""
    _remember: tuple[bool, bool] = field(default=(False, False), init=False)
    """Whether the previous and the current step's split was chosen regardless of the
    measurements (the warm-up's even split, a probe): their timings are remembered."""

    def __post_init__(self) -> None:
        cfg = self.config
        self.fitters = [NodeFitter() for _ in range(cfg.world_size)]
        self.cpu_fitters = [CpuFitter() for _ in range(cfg.world_size)]
        self.cpu_cores = [0.0] * cfg.world_size
        self._last_busy = [0] * cfg.world_size
        self.comm_fitter = CommFitter()
        self.idle_comm_fitter = CommFitter()
        self.tracker = PredictionTracker()
        self.chosen_tracker = PredictionTracker()
        self.noise = NoiseScaleTracker(smoothing=cfg.gns_smoothing, init_batch=cfg.init_batch)
        if cfg.max_batch is not None and cfg.world_size < 2 and cfg.micro_cap(0) is None:
            logger.warning("one worker: the total batch stays %d, since the noise scale needs "
                           "two gradient groups (two workers, or one in several passes: "
                           "max_micro_batches with a max_local_batch) to be estimated",
                           cfg.init_batch)
        self.current = self._record(0, "start", self._even(cfg.init_batch), None)
        self._interval = cfg.replan_every
        self._next_replan = cfg.warmup_steps - 1

    # -- what the loader and the runtime ask -------------------------------------------------
    @property
    def total_batch(self) -> int:
        return self.current.total_batch

    @property
    def local_batches(self) -> tuple[int, ...]:
        return self.current.local_batches

    def split_for(self, total: int) -> tuple[int, ...]:
        """The split of ``total`` samples: the plan, or a fresh one for a final partial batch."""
        if total == self.current.total_batch:
            return self.current.local_batches
        if total > self.current.total_batch or total < 0:
            raise ValueError(f"a step takes at most the planned {self.current.total_batch} "
                             f"samples, asked for {total}")
        least = self.config.least_busy
        if total < least * self.config.world_size:
            return self._few(total, least)
        if self.cluster_model is not None and self.config.split == "optimal":
            # every worker keeps at least one sample while there are enough to go round (and
            # ``least``, where min_pass or micro_batches raised min_local to it)
            lo = min(self.config.min_local, total // self.config.world_size)
            try:
                return optimal_split(self._bounded(self.cluster_model, min_local=lo),
                                     total).local_batches
            except ValueError as exc:
                logger.debug("partial batch %d: optimal split infeasible (%s), even", total, exc)
        return self._even(total)

    def passes(self, rank: int, batch: int) -> tuple[int, ...]:
        """Worker ``rank``'s micro-batches of a local batch of ``batch`` (one pass unless it
        accumulates beyond its cap, or :attr:`PlannerConfig.micro_batches` of them); the
        same on every rank."""
        if self.config.micro_batches is not None:
            return even_passes(batch, self.config.micro_batches)
        return micro_batches(batch, self.config.micro_cap(rank))

    def _few(self, total: int, least: int) -> tuple[int, ...]:
        """A final partial batch too small for ``least`` samples (its passes, ``min_pass``
        each) on every worker: the workers with the largest shares of the plan (the
        fastest) get at least that many each, the others none; fewer than ``least`` go to
        one worker alone."""
        n = self.config.world_size
        order = sorted(range(n), key=lambda r: (-self.current.local_batches[r], r))
        chosen = set(order[:max(1, total // least)])
        caps = [self.config.cap_of(r) if r in chosen else 0 for r in range(n)]
        try:
            return share_split(total, np.ones(n), caps)
        except ValueError:  # the chosen workers' caps cannot hold it: any that can
            return share_split(total, np.ones(n), [self.config.cap_of(r) for r in range(n)])

    def predicted(self, local_batches: Sequence[int]) -> float | None:
        """Step time the model in force predicts for ``local_batches`` (None without one):
        the expected slowest of the noisy workers (:meth:`ClusterModel.expected_step_time`)."""
        cluster = self.cluster_model
        if cluster is None:
            return None
        split = tuple(local_batches)
        last = self._prediction
        if last is not None and last[0] is cluster and last[1] == split:
            return last[2]  # asked twice a step for the same split: evaluate once
        predicted = cluster.expected_step_time(list(split))
        self._prediction = (cluster, split, predicted)
        return predicted

    @property
    def held(self) -> bool:
        """The plan has held until the re-plan cadence reached its longest interval
        (:attr:`PlannerConfig.max_replan_every`), or it is pinned: every
        :meth:`stride`-th step is measured, the others cost what plain DDP costs (a new
        plan measures every step, but a re-balance of a held one:
        :attr:`PlannerConfig.measure_stride`)."""
        return self._interval >= self.config.max_replan_every

    def measures(self, step: int) -> bool:
        """Whether step ``step`` is measured (:attr:`PlannerConfig.measure_stride`); the
        same answer on every rank, since it depends only on the planner's state."""
        every = self._every_step or self.current.exploring  # a probe or trial: every step
        return (every and not self.held) or step % self.stride(step) == 0

    def stride(self, step: int) -> int:
        """Every how many steps a held plan is measured at step ``step``
        (:attr:`PlannerConfig.measure_stride`, doubling up to :attr:`PlannerConfig.
        max_measure_stride` while the plan holds)."""
        cfg = self.config
        if self._held_since is None or cfg.max_batch is not None:
            return cfg.measure_stride
        doublings = min((step - self._held_since) // (2 * cfg.max_replan_every), 16)
        return min(cfg.measure_stride << doublings, cfg.max_measure_stride)

    def due(self, step: int) -> bool:
        """Whether to re-plan after step ``step`` (0-based)."""
        if self.pinned:
            return False
        return (step >= self._next_replan or self._drifted is not None
                or (self._noise_moved is not None and step >= self._earliest_replan))

    def pin(self, step: int, split: Sequence[int] | npt.NDArray[np.integer] | None) -> None:
        """Hold ``split`` from step ``step`` on, with no re-plan, probe or trial, until
        ``pin(step, None)`` re-plans at once (every rank must pin the same). For a split
        chosen outside: a user's own, a benchmark's fixed ones. The pinned steps are
        measured at the held cadence and the model keeps learning from them."""
        if split is None:
            if self.pinned:
                self.pinned = False
                self._interval = self.config.replan_every
                self._next_replan = step
                self._held_since = None
            return
        n = self.config.world_size
        given = tuple(split)
        if len(given) != n or not all(_is_int(b) and b >= 0 for b in given) or sum(given) < 1:
            raise ValueError(f"a pinned split needs {n} local batches, whole numbers >= 0 "
                             f"with a positive sum, got {list(given)}")
        batches = tuple(int(b) for b in given)  # numpy integers too, as plain ints
        for rank, batch in enumerate(batches):
            cap = self.config.cap_of(rank)
            if cap is not None and batch > cap:
                raise ValueError(f"worker {rank} cannot take {batch} samples in a pinned split "
                                 f"{list(batches)}: its largest local batch is {cap}")
            passes = self.passes(rank, batch)
            if any(0 < size < self.config.min_pass for size in passes):  # an empty pass runs
                raise ValueError(f"worker {rank} cannot take {batch} samples in a pinned split "
                                 f"{list(batches)}: each of its passes {list(passes)} needs 0 "
                                 f"or at least {self.config.min_pass} (min_pass: the model's "
                                 f"BatchNorm refuses a single sample in training)")
        cluster = self.cluster_model
        predicted = None if cluster is None else cluster.expected_step_time(list(batches))
        self.current = self._record(step, "pinned", batches, predicted, cluster=cluster)
        self.pinned = True
        self._trial, self._before_probe, self._drifted = None, None, None
        self._interval = self.config.max_replan_every  # measured at the held cadence
        self._held_since = step
        self._end_windows()

    # -- feeding it ----------------------------------------------------------------------------
    def observe(self, step: int, reports: Sequence[WorkerReport],
                previous_global_sqnorm: float | None) -> None:
        """Fold in step ``step``'s exchange, which carries step ``step - 1``'s measurements
        (``previous_global_sqnorm`` is that step's |g|^2, known on every rank)."""
        if len(reports) != self.config.world_size:
            raise ValueError(f"expected {self.config.world_size} worker reports, got "
                             f"{len(reports)}")
        previous = [r.previous for r in reports]
        reason = self.current.reason
        self._remember = (self._remember[1], self.current.nodes is None
                          or reason.startswith("probe") or reason == "pinned")
        if all(p is not None for p in previous):
            done = [p for p in previous if p is not None]
            sqnorms, batches = self._gradient_groups(done)
            sane = all(math.isfinite(v) and v >= 0 for v in sqnorms)
            if len(batches) >= 2 and previous_global_sqnorm is not None and sane:
                self.noise.update(sqnorms, batches, previous_global_sqnorm)
                self._check_noise()
            self._check_loss(done)
            if step - 1 >= self.config.skip_steps:
                self._observe_timing(step - 1, done)

    def time_step(self, local_batches: Sequence[int], period_s: float,
                  stall_s: float = 0.0) -> None:
        """Count a finished step in :attr:`tracker` (and :attr:`chosen_tracker` at a split
        chosen for speed): the model's step at ``local_batches``, plus ``stall_s`` of a
        re-plan that began it, against ``period_s``, its period on this rank's clock. Call
        it for every step before the re-plan that may follow it. Every step counts: with
        the measured ones alone (every :attr:`PlannerConfig.measure_stride`-th once a plan
        holds) a window's mean was half as sure (10 steps of a 40-step window). A period
        over :data:`GAP_RATIO` times the prediction is left out."""
        predicted = self.predicted(local_batches)
        if predicted is None or period_s > GAP_RATIO * (predicted + stall_s):
            return
        if not self.tracker.record(predicted + stall_s, period_s):
            return
        current = self.current
        if current.nodes is not None and current.reason != "pinned" and not current.exploring:
            self.chosen_tracker.record(predicted + stall_s, period_s)

    def _end_windows(self) -> None:
        """The plan in force ends: close its window in the trackers."""
        self.tracker.end_window()
        self.chosen_tracker.end_window()

    def _check_loss(self, reports: Sequence[StepReport]) -> None:
        """Fold a step's per-sample output gradients into :attr:`loss_check`; say once
        when the loss looks summed over the local batch."""
        medians = [r.output_grad for r in reports]
        if self.loss_check.add(medians, [r.batch for r in reports]) and self.log_plans:
            logger.warning(
                "each sample's gradient at the model's output does not shrink with its "
                "worker's local batch (~ b_i^%.1f over %d steps of uneven batches, where a "
                "mean over the local batch gives b_i^-1): the loss looks summed over the "
                "local batch (reduction='sum', or a sum over a fixed per-rank batch size). "
                "Cannikin weighs worker i's gradient by b_i / B, the mean over the step's "
                "samples only for a loss averaged over the local batch: divide the loss by "
                "len(x), and multiply it by batch_size / world_size for the update plain DDP "
                "makes of a summed loss", self.loss_check.slope, self.loss_check.steps)

    def _gradient_groups(self, reports: Sequence[StepReport]) -> tuple[list[float], list[int]]:
        """The noise scale's independent gradient estimates of a step and their batches:
        each micro-batch where a worker took several and sent their norms, else the worker.
        More groups, less variance (``tests/test_gns.py``), and one worker in passes has
        groups of its own."""
        sqnorms: list[float] = []
        batches: list[int] = []
        for rank, report in enumerate(reports):
            if report.batch <= 0:
                continue
            if report.pass_sqnorms:
                sizes = self.passes(rank, report.batch)
                if len(sizes) != len(report.pass_sqnorms):
                    raise ValueError(f"worker {rank} sent {len(report.pass_sqnorms)} passes' "
                                     f"norms for the {len(sizes)} passes of {report.batch}")
                # an empty pass (fewer samples than micro_batches) estimates nothing
                kept = [(q, b) for q, b in zip(report.pass_sqnorms, sizes, strict=True) if b]
                sqnorms += [q for q, _ in kept]
                batches += [b for _, b in kept]
            else:
                sqnorms.append(report.sqnorm)
                batches.append(report.batch)
        return sqnorms, batches

    def _observe_timing(self, step: int, timings: Sequence[StepReport]) -> None:
        # a re-plan delays the step it begins on every rank by the slowest rank's re-plan
        # (the others wait for it in the all-reduce)
        stall = max(t.plan_s for t in timings)
        if stall > 0:
            self._plan_stalls.append(stall)
        measured = _median([t.step_s + t.plan_s for t in timings])
        for rank, (fitter, t) in enumerate(zip(self.fitters, timings, strict=True)):
            # a step at 0 samples is measured too: the fitter keeps it apart (idle_times)
            fitter.add(t.timed, t.fwd_s, t.bwd_s, remember=self._remember[0])
            if self._at_half_share(t.batch, self.current.total_batch):
                self._last_busy[rank] = step
            if self.config.cpu_floor and t.cpu_s > 0 and t.cpu_cores > 0:
                self.cpu_fitters[rank].add(t.batch, t.cpu_s, remember=self._remember[0],
                                           step=step)
                self.cpu_cores[rank] = t.cpu_cores
        routed = self.config.idle_route and any(t.batch == 0 for t in timings)
        self._add_comm([t for t in timings if t.batch > 0],
                       self.idle_comm_fitter if routed else self.comm_fitter)
        self._check_drift(timings)
        if math.isfinite(measured):
            self._measured.append((tuple(t.batch for t in timings), measured))

    def _check_noise(self) -> None:
        """Flag a re-plan once the cautious noise scale, on which the total batch is chosen,
        has moved by :attr:`PlannerConfig.gns_replan` since the last re-plan."""
        cfg = self.config
        if (cfg.max_batch is None or cfg.gns_replan is None or self.cluster_model is None
                or self._trial is not None or self._before_probe is not None):
            return
        now, chosen = self.noise.cautious_noise_scale(cfg.gns_sigmas), self._chosen_noise
        if now is None or (chosen is not None
                           and abs(math.log(now / chosen)) <= math.log1p(cfg.gns_replan)):
            self._noise_moved = None
        else:
            self._noise_moved = ("noise scale first estimated" if chosen is None
                                 else f"noise scale moved {chosen:.4g} -> {now:.4g}")

    def _check_drift(self, timings: Sequence[StepReport]) -> None:
        """Flag a worker whose measured compute has left its model for several steps, so
        a speed change is followed without waiting for the (backed-off) cadence."""
        cluster, cfg = self.cluster_model, self.config
        if cluster is None:
            return
        if not self._drift_ratios:
            self._drift_ratios = [[] for _ in timings]
        if not self._drift_history:
            self._drift_history = [[] for _ in timings]
        for rank, (node, t) in enumerate(zip(cluster.nodes, timings, strict=True)):
            predicted = node.forward_time(t.timed) + node.backward_time(t.timed)
            ratio = (t.fwd_s + t.bwd_s) / predicted if predicted > 0 else math.nan
            if t.timed <= 0 or not math.isfinite(ratio) or ratio <= 0:
                continue  # no evidence either way (an empty or an invalid measurement)
            recent, history = self._drift_ratios[rank], self._drift_history[rank]
            recent.append(math.log(ratio))
            history.append(recent[-1])
            del recent[:-cfg.drift_steps]
            del history[:-cfg.drift_noise_history]
            if len(recent) < cfg.drift_steps or self._drifted is not None:
                continue
            shift = abs(_median(recent))
            if not large_shift(shift, cfg.drift_change):
                continue  # too small whatever the noise: no noise estimate needed
            # standard error of a median of n: 1.2533 sigma / sqrt(n)
            error = 1.2533 * _noise_sd(history) / math.sqrt(len(recent))
            if lasting_shift(shift, error, cfg.drift_change, cfg.drift_sigmas):
                self._drifted = rank

    def _add_comm(self, active: Sequence[StepReport], fitter: CommFitter) -> None:
        counts = {len(r.allreduce_s) for r in active}
        if len(counts) != 1 or counts == {0}:
            return  # buckets differ between ranks this step (DDP rebuild): skip it
        ready = [_median(bucket)
                 for bucket in zip(*(r.ready_fractions for r in active), strict=True)]
        # the last rank to have a bucket ready waits for nobody: min over ranks is the
        # all-reduce itself
        comm = [_minimum(bucket) for bucket in zip(*(r.allreduce_s for r in active), strict=True)]
        rising = []
        highest = -math.inf
        for r in ready:  # running maximum (NaN propagates, as in np.maximum.accumulate)
            highest = r if math.isnan(r) or math.isnan(highest) else max(highest, r)
            rising.append(highest if math.isnan(highest) else min(max(highest, 0.0), 1.0))
        rising[-1] = 1.0
        fitter.add(rising, comm)

    # -- deciding --------------------------------------------------------------------------------
    def replan(self, step: int, reason: str = "cadence",
               share: Callable[[Callable[[], Decision]], Decision] | None = None) -> PlanRecord:
        """Refit the cluster and choose the split (and total batch) from the next step on.

        Every rank fits alike; ``share`` runs the choice on one rank (:attr:`decider`) and
        hands the :class:`Decision` to all (the runtime's broadcast), so the slowest rank
        waits for the fastest's choice instead of making its own; without it this rank
        chooses for itself. Either way every rank adopts the same decision."""
        self._end_windows()  # this step was its plan's last (time_step came first)
        if self.pinned:  # only an out-of-memory re-plans a pinned split: it no longer fits
            logger.warning("step %d: the pinned split %s is released (%s)", step,
                           list(self.current.local_batches), reason)
            self.pinned = False
        if self._drifted is not None and reason == "cadence":
            reason = f"worker {self._drifted} drifted from its model"
        elif self._noise_moved is not None and reason == "cadence" and step < self._next_replan:
            reason = self._noise_moved
        self._drifted, self._drift_ratios, self._noise_moved = None, [], None
        cluster = self._fit()
        total = self._fitting_total(self.current.total_batch)
        self._chosen_noise = self.noise.cautious_noise_scale(self.config.gns_sigmas)
        if cluster is not None:
            self.cluster_model = cluster

        def decide() -> Decision:
            return self._decide(step, cluster, total)

        decision = decide() if share is None else share(decide)
        if decision.kind == "failed":
            raise RuntimeError(f"step {step}: the re-plan failed on rank {self.decider}, which "
                               f"decides for every rank (its log says why)")
        return self._adopt(step, reason, cluster, decision)

    @property
    def decider(self) -> int:
        """The rank that chooses each re-plan's split for all (:meth:`replan`'s ``share``):
        the most CPU cores reported (:attr:`cpu_cores`), ties to the lowest rank; the same
        on every rank, since the cores come with the exchange."""
        return max(range(self.config.world_size), key=lambda r: (self.cpu_cores[r], -r))

    def _decide(self, step: int, cluster: ClusterModel | None, total: int) -> Decision:
        """The split (and total batch) from step ``step + 1`` on, without changing any state."""
        cfg = self.config
        idle_until = dict(self._idle_until)
        if cluster is None:
            return Decision(local_batches=self._even(total), predicted_s=None,
                            idle_until=idle_until)
        kind, probed, target = "plan", -1, 0
        if cfg.split == "adaptdl" and cfg.max_batch is not None and (
                total < cfg.max_batch and any(len(f.batch_sizes()) < 2 for f in self.fitters)):
            # every worker measured at one batch size: the fit is proportional, without a
            # fixed cost, and the even split's goodput would never favour a larger B
            total = min(2 * total, cfg.max_batch)
            kind = "explore"
        elif cfg.max_batch is not None and (cautious := self._chosen_noise) is not None:
            choose = choose_even_batch_size if cfg.split == "adaptdl" else choose_batch_size
            choice = choose(cluster, cautious, cfg.init_batch, cfg.max_batch, current=total)
            total = choice.total_batch
            plan = choice.plan
        elif cfg.split == "optimal":
            plan = optimal_split(cluster, total)
        if cfg.split == "optimal":
            plan, idle_until = self._idle(step, cluster, plan)
            plan = self._held(cluster, plan)
            if plan.local_batches == self.current.local_batches:
                tried = self._try_zero(step, cluster, plan, idle_until)
                if tried is not None:
                    kind, (probed, plan) = "try", tried
                elif (probe := self._probe(step, cluster, plan)) is not None:
                    kind, (probed, target, plan) = "probe", probe
        else:
            even = self._even(total)
            plan = Plan(local_batches=even, step_time=float(cluster.step_time(list(even))))
        return Decision(local_batches=plan.local_batches,
                        predicted_s=cluster.expected_step_time(list(plan.local_batches)),
                        kind=kind, rank=probed, target=target, idle_until=idle_until,
                        costly=costly_workers(cluster, plan, cfg.costly_speedup))

    def _adopt(self, step: int, reason: str, cluster: ClusterModel | None,
               decision: Decision) -> PlanRecord:
        """Make ``decision`` the plan in force and set the cadence that follows it."""
        cfg = self.config
        previous = self.current
        if cluster is not None and cfg.split == "optimal":
            self._trial = None  # the trial that ended was closed in the decision
        self._idle_until = dict(decision.idle_until)
        if decision.kind == "try":
            self._last_trial[decision.rank] = step
            self._trial = (decision.rank, decision.local_batches, previous.local_batches)
        if decision.kind == "probe":
            self._last_probe = step
        if decision.kind in ("try", "probe"):
            self._before_probe = (previous.local_batches, self._interval)
        record = self._record(step, decision.reason(reason), decision.local_batches,
                              decision.predicted_s, cluster=cluster,
                              noise=self.noise.noise_scale(), costly=decision.costly)
        # a plan that holds is re-checked less and less often (planning costs CPU every
        # step it runs); any change brings the cadence back to replan_every, and a re-plan
        # out of turn (a drift) that changes nothing leaves the cadence as it was
        unchanged = (record.local_batches == previous.local_batches and cluster is not None)
        returned = False  # to the split a probe or trial interrupted
        if decision.kind == "plan":  # against the plan a probe or trial interrupted
            before, interval = self._before_probe or (previous.local_batches, self._interval)
            if record.local_batches != before:
                at_stride = interval >= cfg.max_replan_every or not self._every_step
                same_busy = [b > 0 for b in record.local_batches] == [b > 0 for b in before]
                self._every_step = not (at_stride and same_busy and record.reason == "cadence"
                                        and record.total_batch == previous.total_batch)
        if decision.kind == "probe":
            self._interval = cfg.replan_every  # a probe lasts one short interval
        elif decision.kind == "try":
            self._interval = cfg.trial_steps
        elif self._before_probe is not None:
            split, interval = self._before_probe
            self._before_probe = None
            # back to the split the probe interrupted: its cadence (and the measuring that
            # goes with it) as before, instead of re-learning that the split holds
            returned = split == record.local_batches
            self._interval = interval if returned else cfg.replan_every
        elif not unchanged:
            self._interval = cfg.replan_every
        elif record.reason == "cadence":
            self._interval = min(2 * self._interval, cfg.max_replan_every)
        affordable = self._affordable_interval(record)
        if not record.exploring:
            self._interval = max(self._interval, affordable)
        if decision.kind == "plan":
            kept = record.reason == "cadence" and (unchanged or returned)
            since = self._held_since if kept and self._held_since is not None else step
            self._held_since = since if self.held else None
        self._next_replan = step + self._interval
        self._earliest_replan = step + max(cfg.replan_every, affordable)
        changed = (record.local_batches != previous.local_batches
                   or record.total_batch != previous.total_batch)
        self.current = record
        if self.log_plans:
            self._log(record, cluster, changed)
        return record

    @property
    def plan_stall_s(self) -> float | None:
        """How long a re-plan holds up the step after it: the median over the last few of
        the slowest rank's re-plan time (:attr:`StepReport.plan_s`); None before any."""
        return _median(self._plan_stalls) if self._plan_stalls else None

    def _affordable_interval(self, record: PlanRecord) -> int:
        """The fewest steps from one re-plan to the next for which the re-plans' own time
        stays within :attr:`PlannerConfig.plan_budget` of the steps' (0: no bound)."""
        budget, step_s, stall = self.config.plan_budget, record.predicted_step_s, self.plan_stall_s
        if budget is None or stall is None or not step_s or step_s <= 0:
            return 0
        steps = math.ceil(stall / (budget * step_s))
        return min(steps, self.config.max_replan_every // 2)

    def _log(self, record: PlanRecord, cluster: ClusterModel | None, changed: bool) -> None:
        """One INFO line for a new split or total batch (a re-plan that keeps both is DEBUG),
        the fitted models at DEBUG, a costly worker once as a WARNING."""
        for worker in record.costly:
            if worker.rank in self._costly_said:
                continue
            self._costly_said.add(worker.rank)
            logger.warning(
                "worker %d (%s) slows the step even with 0 samples (its fixed time or its "
                "all-reduce share): %.1f ms per step; without it the step would be %.2fx "
                "faster (%.1f -> %.1f ms)", worker.rank, self.config.names[worker.rank],
                worker.cost_s * 1e3, worker.speedup, worker.step_time * 1e3,
                worker.without_step_time * 1e3)
        logger.log(logging.INFO if changed else logging.DEBUG,
                   "plan at step %d (%s): B=%d split=%s predicted=%s noise_scale=%s",
                   record.step, record.reason, record.total_batch, list(record.local_batches),
                   "n/a" if record.predicted_step_s is None
                   else f"{record.predicted_step_s * 1e3:.1f} ms", record.noise_scale)
        if cluster is not None:
            logger.debug("fitted models: %s; comm %s", list(cluster.nodes), cluster.comm)

    def lower_cap(self, rank: int, failed_batch: int) -> int:
        """Worker ``rank`` ran out of memory at ``failed_batch``: lower its cap; return it."""
        floor = max(self.config.min_local, 1)
        cap = max(floor, min(failed_batch - 1,
                             math.floor(self.config.oom_cap_factor * failed_batch)))
        if failed_batch <= floor:
            raise RuntimeError(f"worker {rank} ran out of memory at local batch {failed_batch}, "
                               f"the smallest allowed ({floor}); nothing smaller to try")
        caps = list(self.config.caps)
        old = caps[rank]
        cap = cap if old is None else min(old, cap)
        caps[rank] = cap
        self.config.caps = tuple(caps)
        logger.warning("worker %d ran out of memory at local batch %d; its cap is now %d",
                       rank, failed_batch, cap)
        return cap

    # -- internals -------------------------------------------------------------------------------
    def _probe(self, step: int, cluster: ClusterModel,
               plan: Plan) -> tuple[int, int, Plan] | None:
        """A probe instead of the held ``plan``: of a worker kept under half its share for
        long (``refresh_after``) first, else of the least-known worker (``probe_error``), or
        of one whose measured CPU makes no floor yet (:meth:`_without_floor`): (its rank,
        its local batch, the probe's split); or None: not due, every fit known well enough
        and recent, no probe that adds a measurement, or none within its budget
        (``probe_budget``)."""
        cfg = self.config
        if (cfg.probe_error is None and cfg.refresh_after is None) or (
                self._last_probe is not None and step - self._last_probe < cfg.probe_every):
            return None
        n = cfg.world_size
        candidates = []
        for rank, (fitter, b) in enumerate(zip(self.fitters, plan.local_batches, strict=True)):
            stale = (not self._at_half_share(b, plan.total_batch)
                     and cfg.refresh_after is not None
                     and step - self._last_busy[rank] >= cfg.refresh_after)
            error = fitter.slope_error()
            if not (stale or (cfg.probe_error is not None and (
                    error > cfg.probe_error or self._without_floor(rank, cluster)))):
                continue
            cap = cfg.cap_of(rank)
            share = plan.total_batch // n
            if not 0.5 * share <= b <= 2 * share:
                target = share
            elif cap is None or 2 * b <= cap:
                target = 2 * b
            else:
                target = b // 2
            target = max(target, cfg.min_local, 1)
            if cap is not None:
                target = min(target, cap)
            near = fitter.nearest_level(target)
            if near is not None and abs(near - target) <= cfg.probe_snap * target:
                target = int(near)  # fill a batch size measured before, not a new one
            full = fitter.level_count(target) >= fitter.level_samples
            if target == b or (full and not stale):
                continue  # nothing to add: the probe's batch size is measured in full
            candidates.append((not stale, -error, rank, target))
        if not candidates:  # every fit known: no expected step to weigh a probe against
            return None
        held = cluster.expected_step_time(list(plan.local_batches))
        since = step - (self._last_probe or 0)
        for by_error, _, rank, target in sorted(candidates):
            fixed = [dataclasses.replace(nd, min_batch=target, max_batch=target) if i == rank
                     else nd for i, nd in enumerate(cluster.nodes)]
            try:
                probe = optimal_split(ClusterModel(nodes=fixed, comm=cluster.comm,
                                                   idle_comm=cluster.idle_comm),
                                      plan.total_batch)
            except ValueError:
                continue  # the others cannot take the rest
            extra = cluster.expected_step_time(list(probe.local_batches)) - held
            if extra * cfg.replan_every > cfg.probe_budget * held * since:
                if not by_error:  # a refresh waits for its budget: cheaper probes
                    return None  # would spend it first, every time
                continue  # it would cost more than its share of the time so far
            return rank, target, probe
        return None

    def _at_half_share(self, batch: int, total: int) -> bool:
        """Whether a local batch of ``batch`` is half the even share of ``total`` or more:
        a measurement at work for :attr:`PlannerConfig.refresh_after`."""
        return 2 * batch * self.config.world_size >= total

    def _idle(self, step: int, cluster: ClusterModel,
              plan: Plan) -> tuple[Plan, dict[int, int]]:
        """``plan`` with the workers a trial showed faster at 0 (:attr:`PlannerConfig.
        trial_margin`) kept there, counting the trial that just ended; else
        :meth:`_with_zeros`. With the workers kept at 0 from now on."""
        idle_until = {r: end for r, end in self._idle_until.items() if end > step}
        if self._trial is not None and (kept := self._trial_kept(step)) is not None:
            idle_until[self._trial[0]] = kept
        if idle_until:
            try:
                return split_without(cluster, plan.total_batch, idle_until), idle_until
            except ValueError:
                idle_until = {}  # the others cannot hold the batch (a cap came down)
        return self._with_zeros(cluster, plan), idle_until

    def _without_floor(self, rank: int, cluster: ClusterModel) -> bool:
        """Whether worker ``rank`` has a measured CPU (:attr:`PlannerConfig.cpu_floor`) but
        no floor from it in ``cluster`` (the model just fitted, :meth:`_with_cpu_floors`):
        its busy batch sizes too close together (a held split and the warm-up's even share,
        160-175 samples on the half-core worker of ``bench_real --model transformer``),
        where that worker's CPU per step may be what sets it."""
        return (self.config.cpu_floor and self.cpu_cores[rank] > 0
                and self.cpu_fitters[rank].num_samples > 0
                and cluster.nodes[rank].cpu_floor is None)

    def _trial_kept(self, step: int) -> int | None:
        """Compare the ending trial's measured steps with the split before it: the step
        until which the tried worker stays at 0 if the trial was faster by more than
        ``trial_gain``, else None."""
        assert self._trial is not None
        rank, tried, before = self._trial
        cfg = self.config
        during = [s for split, s in self._measured if split == tried]
        earlier = [s for split, s in self._measured if split == before][-cfg.trial_steps:]
        if len(during) < 3 or len(earlier) < 3:
            return None
        with_zero, without = _median(during), _median(earlier)
        if with_zero >= (1.0 - cfg.trial_gain) * without:
            return None
        logger.info("worker %d at 0 samples: measured %.1f ms per step against %.1f ms at %s; "
                    "it stays at 0 for %d steps", rank, with_zero * 1e3, without * 1e3,
                    list(before), cfg.trial_every)
        return step + cfg.trial_every

    def _try_zero(self, step: int, cluster: ClusterModel, plan: Plan,
                  idle_until: dict[int, int]) -> tuple[int, Plan] | None:
        """A trial of the held ``plan``'s least-loaded worker at 0 samples (its rank and the
        trial's split; ``idle_until`` stay at 0 too), or None: the model predicts it too
        slow, the worker was tried lately, or the held split has too few measured steps to
        compare with."""
        cfg = self.config
        busy = [(b, r) for r, b in enumerate(plan.local_batches) if b > 0]
        if cfg.trial_margin <= 0 or not cfg.allow_zero or len(busy) < 2:
            return None
        fewest, rank = min(busy)
        unseen = cfg.idle_route and not self.idle_comm_fitter.num_samples
        if not unseen and fewest > cfg.trial_share * plan.total_batch / cfg.world_size:
            return None
        if step - self._last_trial.get(rank, -cfg.trial_every) < cfg.trial_every:
            return None
        if sum(split == plan.local_batches for split, _ in self._measured) < 3:
            return None
        try:
            trial = split_without(cluster, plan.total_batch, {rank, *idle_until})
        except ValueError:
            return None
        if cluster.expected_step_time(list(trial.local_batches)) > (
                1.0 + cfg.trial_margin) * cluster.expected_step_time(list(plan.local_batches)):
            return None
        return rank, trial

    def _with_zeros(self, cluster: ClusterModel, plan: Plan) -> Plan:
        """``plan``, or a faster one where some workers get 0 samples (``allow_zero``):
        where a worker is at its minimum, or where a step with an idle worker has an
        all-reduce of its own (:func:`~cannikin.optperf.zero_split` decides both)."""
        if not self.config.allow_zero:
            return plan
        return zero_split(cluster, plan.total_batch, expected=True, optimal=plan)

    def _hold_tolerance(self, cluster: ClusterModel) -> float:
        """How much faster a new split must be predicted to replace the one in force (see
        :attr:`PlannerConfig.hold_sigmas`)."""
        error = max((node.noise / math.sqrt(max(fitter.num_samples, 1))
                     for node, fitter in zip(cluster.nodes, self.fitters, strict=True)),
                    default=0.0)
        return max(self.config.plan_hold, self.config.hold_sigmas * error)

    def _held(self, cluster: ClusterModel, plan: Plan) -> Plan:
        """The split in force instead of ``plan`` if it is as good (:meth:`_hold_tolerance`)."""
        current = self.current.local_batches
        if current == plan.local_batches or sum(current) != sum(plan.local_batches):
            return plan
        lo = np.array([n.min_batch for n in cluster.nodes])  # what optimal_split planned in
        hi = np.array([math.inf if n.max_batch is None else n.max_batch for n in cluster.nodes])
        now = np.asarray(current)
        fits = (lo <= now) | ((now == 0) & self.config.allow_zero)
        if not np.all(fits & (now <= hi)):
            return plan  # a cap came down: the old split no longer fits
        kept = float(cluster.step_time(list(current)))
        hold = 1.0 + self._hold_tolerance(cluster)
        idle = (now == 0) & (np.asarray(plan.local_batches) == 0)
        if np.any(idle):
            # idle in both: their fixed time is no reason to keep a split of the others
            # that the new plan beats among themselves (the max of all would be flat)
            busy_kept = float(np.max(cluster.node_times(list(current))[~idle]))
            busy_new = float(np.max(cluster.node_times(list(plan.local_batches))[~idle]))
            if busy_kept > hold * busy_new:
                return plan
        if kept <= hold * plan.step_time:
            return Plan(local_batches=current, step_time=kept)
        return plan

    def _fitting_total(self, total: int) -> int:
        """``total``, lowered to what the caps can hold (after out-of-memory lowered them)."""
        room = [self.config.cap_of(i) for i in range(self.config.world_size)]
        if None in room:
            return total
        fits = sum(r for r in room if r is not None)
        if fits < total:
            logger.warning("the local caps %s hold only %d samples: total batch %d -> %d",
                           room, fits, total, fits)
        return min(total, fits)

    def _even(self, total: int) -> tuple[int, ...]:
        """As even as the caps allow."""
        n = self.config.world_size
        return share_split(total, np.ones(n), [self.config.cap_of(i) for i in range(n)])

    def _fit(self) -> ClusterModel | None:
        cfg = self.config
        bounds = [cfg.cap_of(i) for i in range(cfg.world_size)]
        fitted = fit_nodes(self.fitters, cfg.names, [cfg.min_local] * cfg.world_size, bounds)
        nodes = []
        for rank, (name, cap, model) in enumerate(zip(cfg.names, bounds, fitted, strict=True)):
            if model is None and name in self.cached:  # measured before a restart, not since
                model = dataclasses.replace(self.cached[name], min_batch=cfg.min_local,
                                            max_batch=cap)
            if model is None:
                return None
            micro = cfg.micro_cap(rank)
            if micro is not None or cfg.micro_batches is not None:  # else as fitted
                model = dataclasses.replace(model, micro_batch=micro,
                                            fixed_passes=cfg.micro_batches)
            nodes.append(model)
        comm = self.comm_fitter.fit()
        idle_comm = self.idle_comm_fitter.fit()
        return ClusterModel(nodes=self._with_cpu_floors(nodes),
                            comm=comm or idle_comm or CommModel(),
                            idle_comm=idle_comm if comm is not None else None)

    def _with_cpu_floors(self, nodes: list[NodeModel]) -> list[NodeModel]:
        """``nodes`` with each worker's CPU per step over its cores as its ``cpu_floor``,
        where two of its batch sizes are measured (:meth:`CpuFitter.floor_line`), at 0
        samples as its ``cpu_idle`` where measured (:meth:`CpuFitter.idle`), and its
        relative spread as its ``cpu_noise`` (:meth:`CpuFitter.noise`)."""
        if not self.config.cpu_floor or not any(f.num_samples for f in self.cpu_fitters):
            return nodes
        floored = []
        for node, fitter, cores in zip(nodes, self.cpu_fitters, self.cpu_cores, strict=True):
            line = fitter.floor_line() if cores > 0 else None
            idle = fitter.idle() if line is not None else None
            floored.append(node if line is None else dataclasses.replace(
                node, cpu_floor=(line[0] / cores, line[1] / cores),
                cpu_idle=None if idle is None else idle / cores, cpu_noise=fitter.noise()))
        return floored

    def _bounded(self, cluster: ClusterModel, *, min_local: int) -> ClusterModel:
        """The same models with this config's bounds and caps applied."""
        nodes = [dataclasses.replace(n, min_batch=min_local, max_batch=self.config.cap_of(i),
                                     micro_batch=self.config.micro_cap(i),
                                     fixed_passes=self.config.micro_batches)
                 for i, n in enumerate(cluster.nodes)]
        return ClusterModel(nodes=nodes, comm=cluster.comm, idle_comm=cluster.idle_comm)

    def _record(self, step: int, reason: str, split: tuple[int, ...], predicted: float | None,
                *, cluster: ClusterModel | None = None, noise: float | None = None,
                costly: tuple[CostlyWorker, ...] = ()) -> PlanRecord:
        record = PlanRecord(step=step, reason=reason, total_batch=sum(split),
                            local_batches=tuple(split), predicted_step_s=predicted,
                            nodes=None if cluster is None else tuple(cluster.nodes),
                            comm=None if cluster is None else cluster.comm, noise_scale=noise,
                            costly=costly)
        self.history.append(record)
        return record

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Plain numbers: fitted models by device name, total batch, communication model,
        noise scale. Memory caps are not kept: a cap lowered after an out-of-memory is
        found again (one skipped step) if the run resumes on the same device."""
        models = dict(self.cached)
        if self.cluster_model is not None:
            models.update({n.name: n for n in self.cluster_model.nodes})
        return {
            "version": _STATE_VERSION,
            "total_batch": self.current.total_batch,
            "models": {name: [*m.fwd, *m.bwd] for name, m in models.items()},
            "comm": [list(b) for b in self.cluster_model.comm.buckets]
            if self.cluster_model is not None else [],
            "noise": self.noise.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a :meth:`state_dict`, possibly saved with another world size.

        Models of device names seen before are used until this run measures its own; if
        every worker has one, the plan is made at once (DESIGN.md §5: re-plan immediately
        after a membership change).
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"planner state version {state.get('version')!r} is not "
                             f"supported (expected {_STATE_VERSION})")
        models = state["models"]
        total = state["total_batch"]
        if not isinstance(models, dict) or not isinstance(total, int) or total < 1:
            raise ValueError(f"malformed planner state: models={models!r}, total={total!r}")
        self.cached = {str(name): NodeModel(fwd=(float(v[0]), float(v[1])),
                                            bwd=(float(v[2]), float(v[3])), name=str(name))
                       for name, v in models.items()}
        noise = state["noise"]
        if isinstance(noise, dict):
            self.noise.load_state_dict(noise)
        comm = state["comm"]
        room = [self.config.cap_of(i) for i in range(self.config.world_size)]
        if None not in room:
            total = min(total, sum(r for r in room if r is not None))
        self.current = self._record(0, "resume", self._even(total), None)
        if isinstance(comm, list) and comm:
            self.comm_fitter, self.idle_comm_fitter = CommFitter(), CommFitter()
            cached_comm = CommModel(buckets=[(float(r), float(c)) for r, c in comm])
        else:
            cached_comm = CommModel()
        if all(name in self.cached for name in self.config.names):
            nodes = [self.cached[name] for name in self.config.names]
            self.cluster_model = self._bounded(ClusterModel(nodes=nodes, comm=cached_comm),
                                               min_local=self.config.min_local)
            plan = self._with_zeros(self.cluster_model, optimal_split(self.cluster_model, total))
            if self.config.split in ("even", "adaptdl"):
                plan = Plan(local_batches=self._even(total),
                            step_time=self.cluster_model.step_time(list(self._even(total))))
            self.current = self._record(0, "resume with cached models", plan.local_batches,
                                        plan.step_time, cluster=self.cluster_model)
