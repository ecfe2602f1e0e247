"""Batch-size and split policies compared by the simulator.

Every policy but the oracle is built from a :class:`PolicyContext` and learns only from
:class:`Measurement` objects, using the project's real planner code (``cannikin.perf``,
``cannikin.optperf``, ``cannikin.goodput``, ``cannikin.gns``). The oracle is the limit:
OptPerf and goodput on the noise-free ground truth with the true noise scale.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from cannikin.gns import NoiseScaleTracker
from cannikin.goodput import choose_batch_size
from cannikin.optperf import Plan, optimal_split, share_split
from cannikin.perf import ClusterModel, CommFitter, NodeFitter, NodeModel, fit_nodes
from cannikin.sim.measure import Measurement, PolicyContext

if TYPE_CHECKING:
    from cannikin.sim.truth import GroundTruth


class Policy(ABC):
    """Decides the next split; learns from the measurement of the steps it ran."""

    name: ClassVar[str]
    needs_gradient_norms: ClassVar[bool] = False
    """Whether its runtime gathers per-worker gradient norms (costly to simulate)."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self._caps = np.array(ctx.max_share, dtype=np.int64)
        """Largest local batch per worker (passes included)."""

    @abstractmethod
    def decide(self) -> tuple[int, ...]:
        """Local batch sizes for the next block of steps."""

    @abstractmethod
    def observe(self, m: Measurement) -> None:
        """Learn from the block just run."""

    def predicted_step_time(self) -> float:
        """The policy's own prediction for its last decision (NaN if it has no model)."""
        return math.nan

    def _even(self, total: int) -> tuple[int, ...]:
        return share_split(total, np.ones(self.ctx.num_workers), self._caps.tolist(), minimum=1)


class DDP(Policy):
    """PyTorch DDP: the initial batch, split evenly, forever."""

    name = "ddp"

    def decide(self) -> tuple[int, ...]:
        return self._even(self.ctx.start_batch)

    def observe(self, m: Measurement) -> None:
        pass


class LBBSP(Policy):
    """LB-BSP-style: fixed batch, split in proportion to each worker's measured throughput.

    Throughput is samples per second of compute, smoothed; it knows nothing of
    communication or overlap.
    """

    name = "lb-bsp"
    smoothing: ClassVar[float] = 0.5

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._rate: np.ndarray | None = None

    def decide(self) -> tuple[int, ...]:
        if self._rate is None:
            return self._even(self.ctx.start_batch)
        return share_split(self.ctx.start_batch, self._rate, self._caps.tolist(), minimum=1)

    def observe(self, m: Measurement) -> None:
        compute = np.median(m.fwd_s + m.bwd_s, axis=0)
        rate = np.asarray(m.timed, dtype=float) / compute
        self._rate = rate if self._rate is None else (
            self.smoothing * self._rate + (1 - self.smoothing) * rate)


class _Learning(Policy):
    """Shared learning state: speed fitters, comm fitter, noise-scale tracker.

    The first block runs the start batch evenly and the second a probe at twice that
    (as Cannikin's initial profiling does), so every speed model has two distinct batch
    sizes before it is used; a model fitted from one batch size is proportional and
    would never justify a larger batch. Learned lines are trusted only near the batch
    sizes they were measured at: a worker's local batch may grow to at most
    ``extrapolation`` times the largest it has run (real devices are sub-linear at small
    batches, so a line fitted there extrapolates to wildly optimistic speeds).
    """

    extrapolation: ClassVar[float] = 2.0
    probe_factor: ClassVar[int] = 2
    needs_gradient_norms = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._blocks = 0
        self._seen = np.zeros(ctx.num_workers, dtype=np.int64)
        self._comm = CommFitter()
        self._noise = NoiseScaleTracker(init_batch=ctx.init_batch)
        self._batch = ctx.start_batch
        self._predicted = math.nan

    def predicted_step_time(self) -> float:
        return self._predicted

    def decide(self) -> tuple[int, ...]:
        if self._blocks == 0:
            return self._even(self._batch)
        if self._blocks == 1:
            probe = min(self.probe_factor * self._batch, self.ctx.max_batch,
                        int(self._caps.sum()))
            return self._even(probe)
        return self._plan()

    @abstractmethod
    def _plan(self) -> tuple[int, ...]:
        """The split from the learned models (called once both profiling blocks ran)."""

    def _noise_scale(self) -> float | None:
        phi = self._noise.noise_scale()
        if phi is None or not math.isfinite(phi):
            return None
        return max(float(phi), 0.0)

    def _choose(self, cluster: ClusterModel) -> tuple[int, ...]:
        phi = self._noise_scale()
        if phi is None:
            plan = optimal_split(cluster, self._batch)
        else:
            max_batch = min(self.ctx.max_batch,
                            sum(nd.max_batch or 0 for nd in cluster.nodes))
            choice = choose_batch_size(cluster, phi, self.ctx.init_batch, max_batch,
                                       current=self._batch)
            self._batch = choice.total_batch
            plan = choice.plan
        self._predicted = plan.step_time
        return tuple(int(b) for b in plan.local_batches)

    def _trusted_caps(self) -> np.ndarray:
        grown = np.ceil(self.extrapolation * np.maximum(self._seen, 1)).astype(np.int64)
        return np.minimum(self._caps, grown)

    def _passes(self, node: NodeModel, cap: int) -> NodeModel:
        """``node`` running passes of at most ``cap`` (its memory) where passes are allowed."""
        if self.ctx.max_micro_batches == 1 or node.max_batch is None or node.max_batch <= cap:
            return node
        return dataclasses.replace(node, micro_batch=cap)

    def _observe_common(self, m: Measurement) -> None:
        self._blocks += 1
        self._seen = np.maximum(self._seen, np.asarray(m.local_batches, dtype=np.int64))
        for rho, comm in zip(m.ready_fractions, m.allreduce_s, strict=True):
            self._comm.add(list(rho), list(comm))
        if m.local_sqnorms.shape[1] >= 2:
            for sq, gsq in zip(m.local_sqnorms, m.global_sqnorm, strict=True):
                self._noise.update(list(sq), list(m.local_batches), float(gsq))


class AdaptDL(_Learning):
    """AdaptDL/Pollux: adaptive batch by goodput under a homogeneous-cluster model.

    It fits one speed model for "a worker" from the synchronised step (the slowest
    worker's phases, which is what every replica waits for), assumes all workers are
    that worker, and therefore always splits evenly.
    """

    name = "adaptdl"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._node = NodeFitter()

    def _plan(self) -> tuple[int, ...]:
        model = self._node.fit(name="replica")
        comm = self._comm.fit()
        if model is None or comm is None:
            return self._even(self._batch)
        cap = int(self._trusted_caps().min())
        memory = min(self.ctx.max_local_batch)
        nodes = [self._passes(NodeModel(fwd=model.fwd, bwd=model.bwd, max_batch=cap,
                                        min_batch=1, name=f"replica{i}"), memory)
                 for i in range(self.ctx.num_workers)]
        split = self._choose(ClusterModel(nodes=nodes, comm=comm))
        return self._even(sum(split))

    def observe(self, m: Measurement) -> None:
        b = float(np.median(m.timed))
        for fwd, bwd in zip(m.fwd_s.max(axis=1), m.bwd_s.max(axis=1), strict=True):
            self._node.add(b, float(fwd), float(bwd))
        self._observe_common(m)


class Cannikin(_Learning):
    """Cannikin: per-worker learned models, OptPerf split, goodput-chosen batch."""

    name = "cannikin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._nodes = [NodeFitter() for _ in range(ctx.num_workers)]

    def _plan(self) -> tuple[int, ...]:
        comm = self._comm.fit()
        caps = self._trusted_caps()
        models = fit_nodes(self._nodes, [str(i) for i in range(len(caps))], [1] * len(caps),
                           [int(cap) for cap in caps])
        fitted = [self._passes(mdl, memory) for mdl, memory
                  in zip(models, self.ctx.max_local_batch, strict=True) if mdl is not None]
        if comm is None or len(fitted) < len(models):
            return self._even(self._batch)
        return self._choose(ClusterModel(nodes=fitted, comm=comm))

    def observe(self, m: Measurement) -> None:
        for i, fitter in enumerate(self._nodes):
            b = m.timed[i]
            for fwd, bwd in zip(m.fwd_s[:, i], m.bwd_s[:, i], strict=True):
                fitter.add(b, float(fwd), float(bwd))
        self._observe_common(m)


class Oracle(Policy):
    """The limit: OptPerf and goodput on the noise-free ground truth, true noise scale.

    The true compute curves are not linear, so it linearises them around its current
    split and re-plans until the split stops moving (``GroundTruth.linearised_plan``).
    """

    name = "oracle"

    def __init__(self, ctx: PolicyContext, truth: GroundTruth) -> None:
        super().__init__(ctx)
        self._truth = truth
        self._split = np.array(self._even(ctx.start_batch), dtype=float)
        self._batch = ctx.start_batch
        self._progress = 0.0
        self._elapsed = 0.0
        self._predicted = math.nan

    def predicted_step_time(self) -> float:
        return self._predicted

    def decide(self) -> tuple[int, ...]:
        truth = self._truth
        phi = truth.noise_scale(self._progress / truth.workload.target_samples)
        max_batch = min(self.ctx.max_batch, int(self._caps.sum()))
        choices = []

        def plan(cluster: ClusterModel) -> Plan:
            choice = choose_batch_size(cluster, phi, self.ctx.init_batch, max_batch,
                                       current=self._batch, min_gain=0.0)
            choices.append(choice)
            return choice.plan

        _, best = truth.linearised_plan(plan, self._split, self._elapsed)
        self._batch = choices[-1].total_batch
        self._split = np.array(best.local_batches, dtype=float)
        self._predicted = truth.expected_step_time(self._split, self._elapsed)
        return tuple(int(b) for b in best.local_batches)

    def observe(self, m: Measurement) -> None:
        truth = self._truth
        frac = self._progress / truth.workload.target_samples
        self._progress += m.steps * m.total_batch * truth.efficiency(m.total_batch, frac)
        self._elapsed = m.elapsed_s


#: Policies that learn from measurements only, by name, in report order.
LEARNING_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (DDP, AdaptDL, LBBSP, Cannikin)
}
POLICY_NAMES: tuple[str, ...] = (*LEARNING_POLICIES, Oracle.name)
