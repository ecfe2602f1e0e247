"""The simulator's ground truth: what a step really costs on a described cluster.

Deliberately richer than the planner's linear model (DESIGN.md §6):

* compute per phase is ``overhead + (sqrt(b^2 + knee^2)) / rate``: sub-linear at small
  batches (the device is under-used), linear once saturated; the knee grows with device
  speed;
* every step draws multiplicative noise per worker and phase, plus rare spikes (a worker
  pauses, e.g. for garbage collection or a data-loader stall);
* gradients are all-reduced per bucket on a timeline: bucket j can start only when every
  worker has produced it *and* bucket j-1 is done; a ring all-reduce of ``s`` bytes over
  ``n`` workers costs ``latency + 2 (n - 1) / n * s / bandwidth``, itself noisy;
* scheduled stragglers and drift slow a worker's compute.

Policies never get this object (see :mod:`cannikin.sim.engine`); they see
:class:`cannikin.sim.measure.Measurement` only. Only the oracle is handed the truth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cannikin.optperf import Plan
from cannikin.perf import ClusterModel, CommModel, NodeModel, micro_batches
from cannikin.sim.cluster import ClusterSpec
from cannikin.sim.profiles import Workload, device

#: Dimension of the simulated gradient vectors (isotropic Gaussian noise model).
GRAD_DIM = 64
#: Normal draws per chunk when simulating gradients (bounds memory for large clusters).
_GRAD_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class NoiseConfig:
    """How noisy the simulated cluster is."""

    compute_cv: float = 0.04
    """Per-step multiplicative noise (log-normal sigma) of each worker's compute phases."""
    comm_cv: float = 0.05
    """Per-step multiplicative noise of each bucket's all-reduce time."""
    spike_prob: float = 0.001
    """Probability that a worker's step is hit by a pause."""
    spike_factor: tuple[float, float] = (1.3, 2.0)
    """Range of the slow-down a pause causes (uniform)."""

    def __post_init__(self) -> None:
        if min(self.compute_cv, self.comm_cv, self.spike_prob) < 0 or self.spike_prob > 1:
            raise ValueError(f"noise levels must be >= 0 (spike_prob <= 1), got {self}")


@dataclass(frozen=True)
class StepBlock:
    """Ground truth of ``steps`` consecutive steps with one split."""

    fwd_s: np.ndarray        # (steps, n), earlier passes included
    bwd_s: np.ndarray        # (steps, n), the last pass's
    allreduce_s: np.ndarray  # (steps, m) duration of each bucket's all-reduce
    step_s: np.ndarray       # (steps,)
    first_batch: np.ndarray  # (n,) samples of each worker's first pass
    first_fwd_s: np.ndarray  # (steps, n) the first pass's forward (what the runtime times)
    first_bwd_s: np.ndarray  # (steps, n) and backward


class GroundTruth:
    """Step-time and gradient-statistics ground truth for one cluster and workload."""

    def __init__(self, spec: ClusterSpec, workload: Workload,
                 noise: NoiseConfig | None = None, max_micro_batches: int = 1) -> None:
        if not isinstance(max_micro_batches, int) or max_micro_batches < 1:
            raise ValueError(f"max_micro_batches must be an integer >= 1, got "
                             f"{max_micro_batches!r}")
        self.spec = spec
        self.workload = workload
        self.noise = noise or NoiseConfig()
        self.max_micro_batches = max_micro_batches
        """A worker's local batch may reach this many passes of its memory cap
        (``max_local_batch``), gradients accumulated (1: one pass)."""
        profiles = [device(name) for name in spec.devices]
        n = spec.num_workers
        self.num_workers = n
        rate = np.array([p.relative_speed for p in profiles]) * workload.v100_samples_per_s
        ff = workload.forward_fraction
        self._fwd_per_sample = ff / rate
        self._bwd_per_sample = (1.0 - ff) / rate
        self._knee = workload.knee_v100 * np.array([p.relative_speed for p in profiles])
        optimizer_s = np.array([workload.params * workload.state_bytes_per_param
                                / (p.memory_bandwidth_gbs * 1e9) for p in profiles])
        self._fwd_overhead = 0.5e-3 * workload.overhead_ms + optimizer_s
        self._bwd_overhead = np.full(n, 0.5e-3 * workload.overhead_ms)
        self.max_local_batch = np.array([workload.max_local_batch(p) for p in profiles])
        for name, cap in zip(spec.devices, self.max_local_batch, strict=True):
            if cap < 1:
                raise ValueError(f"workload {workload.name!r} does not fit in the memory "
                                 f"of a {device(name).name} ({device(name).memory_gb:g} GB)")
        self.ready = np.array([r for r, _ in workload.buckets])
        bucket_bytes = np.array([s for _, s in workload.buckets]) * workload.gradient_bytes
        ring = 2.0 * (n - 1) / n if n > 1 else 0.0
        latency = spec.latency_us * 1e-6 if n > 1 else 0.0
        self.allreduce_s = latency + ring * bucket_bytes / spec.bandwidth_bytes_per_s

    # --- compute ------------------------------------------------------------------------

    def slowdown(self, t: float) -> np.ndarray:
        """Per-worker compute slow-down factor at simulated time ``t``."""
        factor = np.ones(self.num_workers)
        for s in self.spec.slowdowns:
            if s.start_s <= t < s.start_s + s.duration_s:
                factor[s.worker] *= s.factor
        return factor

    @property
    def max_share(self) -> np.ndarray:
        """Per-worker largest local batch: the memory cap times the passes allowed."""
        result: np.ndarray = self.max_local_batch * self.max_micro_batches
        return result

    def pass_compute(self, batch: np.ndarray, t: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Noise-free forward and backward time of one pass of ``batch`` samples per worker
        (shape (n,) or (k, n)) at time ``t``."""
        b = np.asarray(batch, dtype=float)
        work = np.sqrt(b * b + self._knee ** 2) * self.slowdown(t)
        return (self._fwd_overhead + self._fwd_per_sample * work,
                self._bwd_overhead + self._bwd_per_sample * work)

    def expected_compute(self, local_batches: np.ndarray, t: float = 0.0
                         ) -> tuple[np.ndarray, np.ndarray]:
        """Noise-free forward and backward time per worker at time ``t``. A local batch
        beyond the memory cap runs as :func:`~cannikin.perf.micro_batches` where passes
        are allowed: the passes before the last count in the forward (they finish before
        the last pass's backward, the one that overlaps the all-reduce)."""
        b = np.asarray(local_batches, dtype=float)
        fwd, bwd = self.pass_compute(b, t)
        if self.max_micro_batches == 1:
            return fwd, bwd
        earlier = np.zeros(self.num_workers)
        last = b.copy()
        for i, cap in enumerate(self.max_local_batch):
            sizes = micro_batches(int(b[i]), int(cap))
            if len(sizes) > 1:
                f, k = self.pass_compute(np.array(sizes[:-1], dtype=float)[:, None], t)
                earlier[i] = float((f[:, i] + k[:, i]).sum())
                last[i] = sizes[-1]
        fwd, bwd = self.pass_compute(last, t)
        return fwd + earlier, bwd

    def expected_step_time(self, local_batches: np.ndarray, t: float = 0.0) -> float:
        """Noise-free step time of one split (the timeline without noise)."""
        fwd, bwd = self.expected_compute(local_batches, t)
        return float(timeline(fwd[None], bwd[None], self.ready, self.allreduce_s[None])[0])

    def first_pass(self, local_batches: np.ndarray) -> np.ndarray:
        """Samples of each worker's first pass (its local batch unless it accumulates)."""
        b = np.asarray(local_batches, dtype=np.int64)
        if self.max_micro_batches == 1:
            return b
        return np.array([micro_batches(int(v), int(cap))[0]
                         for v, cap in zip(b, self.max_local_batch, strict=True)])

    def run_steps(self, local_batches: np.ndarray, t: float, steps: int,
                  rng: np.random.Generator) -> StepBlock:
        """Draw ``steps`` noisy steps with one split, starting at simulated time ``t``."""
        n, m = self.num_workers, len(self.ready)
        fwd, bwd = self.expected_compute(local_batches, t)
        first = self.first_pass(local_batches)
        first_fwd, first_bwd = self.pass_compute(first, t)
        cfg = self.noise
        noise_f = rng.lognormal(0.0, cfg.compute_cv, (steps, n))
        noise_b = rng.lognormal(0.0, cfg.compute_cv, (steps, n))
        spikes = np.where(rng.random((steps, n)) < cfg.spike_prob,
                          rng.uniform(*cfg.spike_factor, (steps, n)), 1.0)
        fwd_s = fwd * noise_f * spikes
        bwd_s = bwd * noise_b * spikes
        comm = self.allreduce_s * rng.lognormal(0.0, cfg.comm_cv, (steps, m))
        step_s = timeline(fwd_s, bwd_s, self.ready, comm)
        return StepBlock(fwd_s=fwd_s, bwd_s=bwd_s, allreduce_s=comm, step_s=step_s,
                         first_batch=first, first_fwd_s=first_fwd * noise_f * spikes,
                         first_bwd_s=first_bwd * noise_b * spikes)

    # --- statistics ---------------------------------------------------------------------

    def noise_scale(self, progress: float) -> float:
        """True per-sample noise scale at training progress ``progress`` in [0, 1]."""
        w = self.workload
        p = min(max(progress, 0.0), 1.0)
        return float(w.noise_scale_start * (w.noise_scale_end / w.noise_scale_start) ** p)

    @staticmethod
    def grad_sqr(progress: float) -> float:
        """True |G|^2: shrinks as training converges."""
        return 1.0 / (1.0 + 9.0 * min(max(progress, 0.0), 1.0))

    def efficiency(self, total_batch: float, progress: float) -> float:
        """True statistical efficiency of ``total_batch`` relative to the initial batch."""
        phi = self.noise_scale(progress)
        return (phi + self.workload.init_batch) / (phi + total_batch)

    def gradient_sqnorms(self, local_batches: np.ndarray, progress: float, steps: int,
                         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Per-worker |g_i|^2 (steps, n) and global |g|^2 (steps,) of simulated gradients.

        g_i = G + e_i with e_i ~ N(0, S / (b_i d) I_d), the global gradient is the
        b_i / B weighted mean, exactly as the runtime's weighted all-reduce computes it.
        """
        b = np.asarray(local_batches, dtype=float)
        g2 = self.grad_sqr(progress)
        s = self.noise_scale(progress) * g2
        mean = np.float32(np.sqrt(g2 / GRAD_DIM))
        scale = np.sqrt(s / (b * GRAD_DIM)).astype(np.float32)[None, :, None]
        weights = (b / b.sum()).astype(np.float32)
        chunk = max(1, _GRAD_CHUNK // (len(b) * GRAD_DIM))
        local_sq, global_sq = [], []
        for start in range(0, steps, chunk):
            noise = rng.standard_normal((min(chunk, steps - start), len(b), GRAD_DIM),
                                        dtype=np.float32)
            local = mean + noise * scale
            local_sq.append((local ** 2).sum(axis=2, dtype=np.float64))
            global_sq.append((np.einsum("i,sid->sd", weights, local) ** 2).sum(
                axis=1, dtype=np.float64))
        return np.concatenate(local_sq), np.concatenate(global_sq)

    # --- linearised views (the oracle and `cannikin plan`) ------------------------------

    def linear_nodes(self, lo: np.ndarray, hi: np.ndarray, t: float = 0.0) -> list[NodeModel]:
        """Per-worker least-squares lines through the true compute curve of one pass on
        [lo_i, hi_i] (with passes allowed, each node's ``micro_batch`` is its memory cap)."""
        lo = np.asarray(lo, dtype=float)
        hi = np.maximum(np.asarray(hi, dtype=float), lo)
        grid = lo + np.linspace(0.0, 1.0, 16)[:, None] * (hi - lo)   # (16, n)
        fwd, bwd = self.pass_compute(grid, t)

        def line(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            db = grid - grid.mean(axis=0)
            var = (db * db).sum(axis=0)
            flat = var <= 0
            slope = np.where(flat, y[0] / grid[0], (db * (y - y.mean(axis=0))).sum(axis=0)
                             / np.where(flat, 1.0, var))
            return np.where(flat, 0.0, y.mean(axis=0) - slope * grid.mean(axis=0)), slope

        (f0, f1), (k0, k1) = line(fwd), line(bwd)
        passes = self.max_micro_batches > 1
        return [NodeModel(fwd=(float(f0[i]), float(f1[i])), bwd=(float(k0[i]), float(k1[i])),
                          max_batch=int(self.max_share[i]), min_batch=1,
                          micro_batch=int(self.max_local_batch[i]) if passes else None,
                          name=f"{i}:{device(self.spec.devices[i]).name}")
                for i in range(self.num_workers)]

    def comm_model(self) -> CommModel:
        """The noise-free bucket layout and all-reduce times."""
        return CommModel(buckets=[(float(r), float(c))
                                  for r, c in zip(self.ready, self.allreduce_s, strict=True)])

    def linear_cluster(self, lo: np.ndarray, hi: np.ndarray, t: float = 0.0) -> ClusterModel:
        return ClusterModel(nodes=self.linear_nodes(lo, hi, t), comm=self.comm_model())

    def linearised_plan(self, plan: Callable[[ClusterModel], Plan], split: np.ndarray,
                        t: float = 0.0, rounds: int = 4) -> tuple[ClusterModel, Plan]:
        """Plan on lines fitted around the split, re-fitted around each new plan's split.

        The true curves are not linear; a line is accurate only near where it was fitted,
        so this iterates until the split stops moving (at most ``rounds`` times).
        """
        current = np.asarray(split, dtype=float)
        cap = self.max_local_batch
        for _ in range(rounds):
            size = current / np.maximum(1.0, np.ceil(current / cap))  # a pass's samples
            lo = np.maximum(1.0, np.floor(size / 2))
            hi = np.minimum(cap, np.ceil(size * 2) + 8)
            cluster = self.linear_cluster(lo, hi, t)
            result = plan(cluster)
            new = np.array(result.local_batches, dtype=float)
            if np.array_equal(new, current):
                break
            current = new
        return cluster, result


def timeline(fwd_s: np.ndarray, bwd_s: np.ndarray, ready: np.ndarray,
             allreduce_s: np.ndarray) -> np.ndarray:
    """Step times of a per-bucket all-reduce timeline, vectorised over steps.

    ``fwd_s``, ``bwd_s``: (steps, n); ``ready``: (m,) fraction of the backward pass after
    which each bucket is ready (last = 1); ``allreduce_s``: (steps, m). Bucket j starts when
    every worker has it and bucket j-1 has finished; the step ends with the last bucket.
    """
    ready_at = (fwd_s[:, :, None] + ready[None, None, :] * bwd_s[:, :, None]).max(axis=1)
    end = np.zeros(fwd_s.shape[0])
    for j in range(len(ready)):
        end = np.maximum(ready_at[:, j], end) + allreduce_s[:, j]
    return end
