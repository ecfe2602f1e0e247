"""HeteroDataParallel: DDP with an uneven, planned split and exact mean gradients.

Per step (driven by :class:`~cannikin.runtime.loader.HeteroDataLoader` and the
optimizer's public step hooks):

1. the loader takes this rank's b_i of the next B samples and calls :meth:`begin_step`,
   which sets the all-reduce weight b_i / B;
2. ``model(x)`` runs DDP's forward and marks where the backward starts (a hook on the
   output's gradient);
3. ``loss.backward()``: the comm hook (:mod:`cannikin.runtime.comm`) captures |g_i|^2,
   scales each bucket and all-reduces a sum, marking bucket-ready and done times
   (``model.backward(loss)`` also recovers from a CUDA out-of-memory in it);
4. ``optimizer.step()``: the pre-hook turns the marks into a
   :class:`~cannikin.runtime.planner.StepReport`, reads every rank's report of the
   previous step if it was measured (they rode with a gradient bucket: no extra
   collective), feeds the planner and the noise scale, applies the LR factor and re-plans
   on the cadence; the post-hook restores the LR and logs metrics.

The cycle of a step runs from the end of the previous backward to the end of this one,
so F_i (``fwd_s``) covers the optimizer step, data loading and the forward, and the
measured step time is the period of the synchronous loop.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NoReturn, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _BufferCommHookLocation

from cannikin.losscheck import MIN_SAMPLES
from cannikin.optperf import Plan
from cannikin.perf import ClusterModel, PredictionTracker
from cannikin.runtime.batches import map_batched
from cannikin.runtime.buffers import BufferSource, broadcast_buffers
from cannikin.runtime.comm import (
    CommState,
    StepReadout,
    finish_failed_backward,
    weighted_allreduce_hook,
)
from cannikin.runtime.decision import Decision
from cannikin.runtime.loader import HeteroDataLoader
from cannikin.runtime.planner import (
    REPORT_SIZE,
    SPLITS,
    Planner,
    PlannerConfig,
    PlanRecord,
    StepReport,
    WorkerReport,
)
from cannikin.runtime.precondition import Preconditioner
from cannikin.runtime.quota import own_cpu_limit
from cannikin.runtime.routes import IdleRoutes, largest_batch_rank
from cannikin.runtime.step_timeout import StepTimeout
from cannikin.runtime.timing import Clock, clock_for
from cannikin.runtime.unmeasured import (
    CLOSURE,
    FORWARD_BETWEEN,
    SEVERAL_BACKWARDS,
    UNSTEPPED,
    LostSteps,
)
from cannikin.scaling import RULES, LRScaler

logger = logging.getLogger(__name__)

SLOWDOWN_ENV = "CANNIKIN_SLOWDOWN"
DEFAULT_SLOWDOWN_PROFILE = (0.004, 0.0004)
"""Emulated reference forward: 4 ms + 0.4 ms per sample (a small MLP on this machine)."""
_STATE_VERSION = 1
NORM_STRIDE = 8
"""Where the noise scale decides nothing (a fixed total batch and an LR rule that does not
read it) it is still reported, from every NORM_STRIDE-th step's gradient norms: taking them
is a pass over the gradient before and after the all-reduce, ~1 ms of CPU per step on a
25%-quota worker (4 ms of its wall time)."""
_RESETTABLE = torch.__version__ >= "2.4"
"""DDP's reducer can be reset after a backward that did not finish (``Reducer._reset_state``,
complete since torch 2.4): what recovering from an out-of-memory in backward needs."""


@dataclass(kw_only=True)
class _Cycle:
    """What HeteroDataParallel carries from step to step, in a plain object: an assignment
    to an nn.Module attribute costs ~25 us (its __setattr__ checks for parameters, buffers
    and submodules), and the dozen of them a step were ~0.4 ms of CPU per step."""

    step: int = 0
    """Optimizer steps taken through the loader."""
    last_metrics: dict[str, Any] = field(default_factory=dict)
    split: tuple[int, ...] | None = None
    """This step's local batches."""
    largest: int = 0
    """The rank with this step's largest local batch (:func:`largest_batch_rank`); before
    any step 0, DDP's source of the buffers."""
    previous: StepReport | None = None
    """This rank's last finished step (the next exchange carries it)."""
    prev_mark: Any = None
    """The clock's mark at the end of the previous step: where this step's cycle starts."""
    measure_from: Any = None
    """Where this step's measured period starts: ``prev_mark``, or the end of the re-plan
    made there. The model predicts steps, and a re-plan is the planner's time, not the
    step's: it took 52 ms of a quarter-core worker's wall time, once in 5-40 steps."""
    prev_cpu: float = 0.0
    """The process's CPU seconds at ``measure_from``."""
    plan_s: float = 0.0
    """Wall seconds of the re-plan between ``prev_mark`` and ``measure_from`` (0: none)."""
    bwd_start: Any = None
    """The clock's mark where the (first pass's) backward started."""
    passes: tuple[int, ...] = ()
    """This rank's micro-batch sizes of the step (one entry without accumulation)."""
    pass_index: int = 0
    """The pass being run (:meth:`HeteroDataParallel.begin_pass`)."""
    first_end: Any = None
    """The mark where the first of several passes ended (the second began)."""
    last_bwd_start: Any = None
    """The mark where the last of several passes' backward started."""
    left_checked: bool = False
    """This step's first backward found no gradient left from before it (a model that may
    run a step in several passes, :meth:`HeteroDataParallel._refuse_gradients_left`)."""
    oom: bool = False
    stepping: bool = False
    """Between the loader handing out a step and its optimizer step."""
    measuring: bool = True
    """This step's timings go to the planner."""
    planned_measuring: bool = True
    """The planner has this step measured (:meth:`Planner.measures`, the same on every rank,
    whether or not this rank was interrupted): the next step's exchange carries it."""
    exchanges: bool = True
    """This step's backward carries the exchange (every rank alike): the step before was
    planned to be measured, or it is the first, or every step exchanges
    (:attr:`_Attached.exchange_every_step`). A step with nothing to report skips it: on a
    quarter-core worker a step that carried it cost 0.3-0.7 ms more CPU than one without."""
    norms: bool = True
    """This step's gradient norms are taken (for the noise scale)."""
    interrupted: bool = False
    """A forward ran between steps (an evaluation), or a step never reached the optimizer."""
    whole: bool = True
    """This step's cycle holds the step alone (not :attr:`interrupted` before it): the
    prediction trackers time it (:meth:`Planner.time_step`)."""
    forward_between: bool = False
    """A forward of this model ran since the last step ended."""
    trained_forward: bool = False
    """A forward of this step ran in training mode with gradients enabled."""
    unmeasured_by: set[str] = field(default_factory=set)
    """This step's causes not to measure it, of :data:`~cannikin.runtime.unmeasured.CAUSES`."""
    lost: LostSteps = field(default_factory=LostSteps)
    """Steps the planner was to measure that such causes kept from it, in a row."""
    scaled: bool = False
    """The LR factor is applied for this step."""
    preconditioned: bool | None = None
    """Adam is past its warm-up; None: not seen yet."""
    said_unattached: bool = False
    """The warning that training runs before :meth:`HeteroDataParallel.attach` was logged."""
    said_idle: bool = False
    """This rank logged what a step of 0 samples means for the script (once a run)."""
    hook_free: bool = False
    """This step runs through :attr:`_Attached.twin` (every rank alike)."""
    reached: bool = False
    """A backward of this hook-free step ran through this model's forward output (so
    through the twin's all-reduce), where the hook's count says so on any other step."""


@dataclass(frozen=True, kw_only=True)
class _Options:
    """The planning options given when wrapping, used once :meth:`HeteroDataParallel.attach`
    has the optimizer and the loader."""

    split: str
    lr_scaling: str
    replan_every: int
    warmup_steps: int
    max_local_batch: int | Sequence[int | None] | None
    max_micro_batches: int
    micro_batches: int | None
    device_name: str | None
    recover_backward_oom: bool | None
    allow_idle: bool
    hook_free: bool


@dataclass(kw_only=True)
class _Attached:
    """The optimizer and loader a model plans for, and what is built from them."""

    optimizer: torch.optim.Optimizer
    loader: HeteroDataLoader
    planner: Planner
    precondition: Preconditioner
    scaler: LRScaler
    noise_decides: bool
    """The noise scale chooses the batch or the LR (norms on every measured step)."""
    exchange_every_step: bool
    """Some worker is on a GPU: a CUDA out-of-memory in any step must reach every rank in
    that step's exchange."""
    idle_routes: IdleRoutes | None
    """Where a step gives some workers 0 samples, they only receive the gradient sum
    (:mod:`cannikin.runtime.routes`); None where every step all-reduces over every rank: a
    GPU job (its out-of-memory handling sends the exchange with the last bucket) and one
    whose model reduces over a process group of its own."""
    hooks: list[Any]
    twin: DistributedDataParallel | None = None
    """A second DDP over the same module, without a comm hook, for the steps that need
    nothing of the hook (:meth:`HeteroDataParallel._runs_hook_free`): DDP's all-reduce in
    C++. Any Python comm hook costs CPU in the backward (the reducer calls into Python for
    each bucket, and each bucket's future must hold a Python object), which a worker held
    to a quarter of a core pays four times over in wall time. Made at the first such step
    (its buckets are one more copy of the gradients), so a job that never runs one has
    none."""


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...


def _grad_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors that require a gradient in a forward's (nested) output, in order: in
    tuples, lists, dicts and dataclasses, as DDP finds them."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield value
        return
    if is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in fields(value)]
    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, tuple | list) or isinstance(value, dict):
        for item in items:
            yield from _grad_tensors(item)


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    return next(_grad_tensors(value), None)


def _summed_global_sqnorm(reports: Sequence[WorkerReport]) -> float | None:
    """|g|^2 of the previous step's all-reduced gradient, from the ranks' shares in the
    exchange (:attr:`StepReport.global_sqnorm`); None unless every rank measured it."""
    shares = [None if r.previous is None else r.previous.global_sqnorm for r in reports]
    if any(share is None for share in shares):
        return None
    total = sum(share for share in shares if share is not None)  # one is not 0
    return total if math.isfinite(total) else None


def _least_per_pass(module: nn.Module) -> int:
    """Fewest samples a training forward of ``module`` takes: 2 where a BatchNorm layer
    normalises each channel over the local batch and refuses one value per channel (a
    BatchNorm1d of features, or any at 1x1 spatial size), else 1. SyncBatchNorm's
    statistics are over every rank's samples, so it takes one, or none."""
    refuses = any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                  and not isinstance(m, nn.SyncBatchNorm) for m in module.modules())
    return 2 if refuses else 1


class HeteroDataParallel(nn.Module):
    """Data-parallel training over workers of different speeds and memory.

    ``split``: "optimal" plans the split by OptPerf; "even" keeps the DDP split (the
    baseline, measured the same way). ``lr_scaling``: "adascale", "adamscale" (for Adam),
    "linear", "sqrt" or "none" (applied when the total batch differs from the loader's
    ``batch_size``); "auto" (the default) is "none" at a fixed total batch, as with DDP
    (a final partial batch trains at the same LR), and with a goodput-chosen one
    "adamscale" for Adam, AdamW and RMSprop, "adascale" for the others.
    ``replan_every``: steps between re-plans after ``warmup_steps`` even-split steps (the
    first two are not measured, :attr:`~cannikin.runtime.planner.PlannerConfig.skip_steps`).
    ``metrics``: a sink with ``log(metrics, step)``, called on rank 0 every step.
    ``max_local_batch``: this rank's memory cap (int), or one per rank; an out-of-memory
    in forward lowers this rank's cap automatically. ``max_micro_batches``: above 1, a
    worker's share of a step may exceed its cap, run as up to this many micro-batches of
    at most the cap with the gradients accumulated (planned where it pays: a total batch
    beyond the caps, or a faster step); iterate :meth:`HeteroDataLoader.steps` then.
    ``micro_batches``: every step of every worker in exactly this many (for a loop that
    counts batches: Lightning's ``accumulate_grad_batches``), :class:`PlannerConfig`'s.
    ``recover_backward_oom``: :meth:`backward` (and :meth:`weighted_backward`) recover from
    a CUDA out-of-memory in the backward (the per-step exchange then rides the last gradient
    bucket; torch >= 2.4); None (the default): where any worker's model is on a GPU and
    torch allows. The same on every rank.
    ``allow_idle``: a worker may be planned 0 samples where the step is faster so (it still
    joins the all-reduce and the update; the gradient stays exact). Its forward then runs
    on an empty batch: its mean loss is NaN and per-batch metrics divide by 0, which code
    written for DDP's equal batches may not take (pytorch/examples' ImageNet ``accuracy``
    raises ZeroDivisionError); False keeps every worker at 1 sample or more (a final
    partial batch of fewer samples than workers still leaves some without).
    ``hook_free``: a step that needs nothing of the comm hook (every worker one pass of the
    same batch, nothing measured or exchanged: half the steps at an even split) runs through
    a second DDP over the same module without the hook, DDP's all-reduce in C++; made at
    the first such step, it costs one more copy of the gradients in memory (its buckets).
    CPU jobs only: where a worker is on a GPU every step exchanges. False: never.
    ``slowdown``: heterogeneity
    emulation factor for this rank; None reads ``CANNIKIN_SLOWDOWN`` if it is set.
    ``slowdown_profile``: (fixed_s, per_sample_s) of the emulated reference device's
    forward (backward takes twice as long); set it above the real compute time.
    ``device_name``: the key under which this worker's fitted model is cached.
    Extra keyword arguments go to DistributedDataParallel. ``optimizer`` and ``loader`` may
    come later, through :meth:`attach`, as with DDP, where the optimizer is built from the
    wrapped model's parameters.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loader: HeteroDataLoader | None = None, *, split: str = "optimal",
                 lr_scaling: str = "auto", replan_every: int = 5, warmup_steps: int = 5,
                 metrics: MetricsSink | None = None,
                 max_local_batch: int | Sequence[int | None] | None = None,
                 max_micro_batches: int = 1, micro_batches: int | None = None,
                 recover_backward_oom: bool | None = None, allow_idle: bool = True,
                 hook_free: bool = True, slowdown: float | None = None,
                 slowdown_profile: tuple[float, float] = DEFAULT_SLOWDOWN_PROFILE,
                 device_name: str | None = None, **ddp_kwargs: Any) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("HeteroDataParallel needs a process group: call "
                               "cannikin.runtime.init_distributed() first")
        if (optimizer is None) != (loader is None):
            raise ValueError("pass both the optimizer and the loader, or neither (and call "
                             "model.attach(optimizer, loader) once both exist)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        if dist.get_backend() == "nccl" and self.device.type != "cuda":
            raise ValueError(f"the process group is nccl, which reduces CUDA tensors only, but "
                             f"the model is on {self.device}: move it to this process's GPU "
                             f"(init_distributed's ctx.device) before wrapping it")
        self.metrics = metrics
        if lr_scaling != "auto" and lr_scaling not in RULES:
            raise ValueError(f"unknown lr_scaling {lr_scaling!r}; valid: 'auto', {list(RULES)}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if (not isinstance(max_micro_batches, int) or isinstance(max_micro_batches, bool)
                or max_micro_batches < 1):
            raise ValueError(f"max_micro_batches must be an integer >= 1 (1: no gradient "
                             f"accumulation), got {max_micro_batches!r}")
        self._options = _Options(split=split, lr_scaling=lr_scaling, replan_every=replan_every,
                                 warmup_steps=warmup_steps, max_local_batch=max_local_batch,
                                 max_micro_batches=max_micro_batches,
                                 micro_batches=micro_batches, device_name=device_name,
                                 recover_backward_oom=recover_backward_oom,
                                 allow_idle=allow_idle, hook_free=hook_free)
        self._emulation = self._install_slowdown(module, slowdown, slowdown_profile)
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device])
        self._ddp_kwargs = ddp_kwargs
        self.ddp = DistributedDataParallel(module, **ddp_kwargs)
        self._buffer_source = BufferSource(group=self.ddp.process_group,
                                           bucket_bytes=self.ddp.broadcast_bucket_size)
        self._take_buffers(self.ddp)
        # the parameters whose gradients DDP all-reduces (:meth:`_gradients_clear`)
        self._trained = [p for p in module.parameters() if p.requires_grad]
        self.clock: Clock = clock_for(self.device)
        self.cpu_cores = own_cpu_limit()  # read again at every re-plan (_replan)
        # no norms until a step of the loader asks for them (before attach: plain DDP)
        self.comm = CommState(clock=self.clock, weight=1.0 / self.world_size,
                              capture_sqnorm=False, times_buckets=False)
        self.ddp.register_comm_hook(self.comm, weighted_allreduce_hook)
        self._cycle = _Cycle()
        self._parts: _Attached | None = None
        self.collective_timeout = StepTimeout()  # lowered from init's once steps are measured
        self._removed = False  # remove_hooks() was called
        if optimizer is not None and loader is not None:
            self.attach(optimizer, loader)

    def _take_buffers(self, ddp: DistributedDataParallel) -> None:
        """``ddp`` broadcasts the buffers from :attr:`_buffer_source` before each forward."""
        ddp._register_buffer_comm_hook(self._buffer_source, broadcast_buffers,
                                       _BufferCommHookLocation.PRE_FORWARD)

    def _hook_free_twin(self) -> DistributedDataParallel:
        """:attr:`_Attached.twin`: DDP over the same module with the same options. A
        collective (it broadcasts rank 0's parameters and buffers, the same on every rank
        by then): every rank makes it at the same step, the first to run hook-free."""
        twin = DistributedDataParallel(self.ddp.module, **self._ddp_kwargs)
        self._take_buffers(twin)
        return twin

    def attach(self, optimizer: torch.optim.Optimizer, loader: HeteroDataLoader) -> None:
        """Start planning with ``optimizer`` (built from this model's parameters) and
        ``loader``, in the usual DDP order: wrap, then build the optimizer, then attach.
        Until then the model trains as plain DDP (the ranks' mean gradient). Every rank
        calls it (it gathers each rank's memory cap and device name)."""
        if self._parts is not None:
            raise RuntimeError("this HeteroDataParallel is attached already: one optimizer "
                               "and one loader per wrapped model")
        if not optimizer.param_groups:
            raise ValueError("the optimizer has no param groups")
        driver = loader.controller
        if isinstance(driver, HeteroDataParallel) and driver is not self and driver.drives:
            raise ValueError(
                "this HeteroDataLoader hands its steps to another HeteroDataParallel already, "
                "which would then train as plain DDP (an even mean of the ranks' gradients "
                "over uneven batches), silently: one loader plans one model's steps. A second "
                "model on the same batches (a GAN's generator) is not supported; give each "
                "wrapped model a loader of its own, or wrap the second in plain "
                "DistributedDataParallel with a batch of the same size on every rank, or on "
                "the step's local batch with its mean loss times world_size * step_share of "
                "the first (read before its optimizer step)")
        options = self._options
        precondition = Preconditioner(optimizer)
        self.comm.transform = precondition if precondition.adaptive else None
        caps, names, recovers, any_gpu = self._gather_identity(options.max_local_batch,
                                                               options.device_name,
                                                               options.recover_backward_oom)
        self.comm.rows_at_last = recovers
        auto = loader.autoscale
        lo, hi = auto.local_bsz_bounds if auto is not None else (1, None)
        least = _least_per_pass(self.ddp.module)
        if loader.batch_size < least * self.world_size:
            raise ValueError(
                f"batch_size={loader.batch_size} over {self.world_size} workers gives some "
                f"worker a single sample, which the model's BatchNorm layers refuse in "
                f"training (more than 1 value per channel): use batch_size >= "
                f"{least * self.world_size} (the total over all workers), or SyncBatchNorm")
        # a step with a worker at 0 reduces over the busy ones only (runtime/routes.py)
        routes = not (any_gpu or recovers or self.comm.group is not None)
        planner = Planner(PlannerConfig(
            world_size=self.world_size, init_batch=loader.batch_size, split=options.split,
            replan_every=options.replan_every, warmup_steps=options.warmup_steps,
            skip_steps=min(PlannerConfig.skip_steps, options.warmup_steps - 1),
            max_batch=None if auto is None else auto.max_batch_size, min_local=lo,
            max_local=hi, min_pass=least, allow_zero=options.allow_idle, caps=caps, names=names,
            accumulate=options.max_micro_batches > 1,
            max_micro_batches=options.max_micro_batches,
            micro_batches=options.micro_batches, idle_route=routes), log_plans=self.rank == 0)
        if options.max_micro_batches > 1 and all(cap is None for cap in caps):
            logger.warning("max_micro_batches=%d without a max_local_batch on any worker: "
                           "no worker has a memory cap to accumulate beyond",
                           options.max_micro_batches)
        lr_scaling = options.lr_scaling
        if lr_scaling == "auto":
            lr_scaling = ("none" if auto is None else
                          "adamscale" if precondition.adaptive else "adascale")
        if lr_scaling != "none" and self.rank == 0:
            self._say_unscaled(optimizer, lr_scaling)
        self._parts = _Attached(
            optimizer=optimizer, loader=loader, planner=planner, precondition=precondition,
            scaler=LRScaler(optimizer, lr_scaling, init_batch=loader.batch_size),
            # the noise scale chooses the batch or the LR: norms on every measured step,
            # else on every NORM_STRIDE-th (for the metrics)
            noise_decides=auto is not None or lr_scaling in ("adascale", "adamscale"),
            exchange_every_step=any_gpu or recovers,
            idle_routes=IdleRoutes(self.rank, self.world_size, self.collective_timeout)
            if routes else None,
            hooks=[optimizer.register_step_pre_hook(self._before_optimizer_step),
                   optimizer.register_step_post_hook(self._after_optimizer_step)])
        loader.attach(self, self.rank, self.world_size)
        logger.info("batch_size %d is the total over %d workers (a DataLoader's batch_size "
                    "is per rank: DDP with %d per rank trains like batch_size=%d here)",
                    loader.batch_size, self.world_size, loader.batch_size,
                    loader.batch_size * self.world_size)

    def _say_unscaled(self, optimizer: torch.optim.Optimizer, rule: str) -> None:
        """Warn where trained parameters are not in ``optimizer``: the LR rule scales its
        learning rate alone (a second optimizer, for a GAN's generator or an embedding
        table, steps at its own LR whatever the total batch), a difference in the update
        that nothing else would show."""
        attached = {id(p) for group in optimizer.param_groups for p in group["params"]}
        outside = [name for name, p in self.ddp.module.named_parameters()
                   if p.requires_grad and id(p) not in attached]
        if outside:
            logger.warning(
                "%d trained parameters of the model (%s) are not in the optimizer given to "
                "attach(): lr_scaling=%r scales that optimizer's learning rate with the "
                "step's total batch, while the optimizer that steps these keeps its own "
                "rate, unscaled. Put them in the attached optimizer's param groups, or train "
                "at a fixed total batch with lr_scaling='none'", len(outside),
                ", ".join(outside[:3]) + (", ..." if len(outside) > 3 else ""), rule)

    @property
    def drives(self) -> bool:
        """Attached, its loader's steps still handed to it, its hooks not removed."""
        parts = self._parts
        return parts is not None and parts.loader.controller is self and not self._removed

    @property
    def attached(self) -> _Attached:
        """What :meth:`attach` set up; a RuntimeError naming the fix before it."""
        if self._parts is None:
            raise RuntimeError("this HeteroDataParallel has no optimizer and loader yet: call "
                               "model.attach(optimizer, loader) (or pass both when wrapping)")
        return self._parts

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.attached.optimizer

    @property
    def loader(self) -> HeteroDataLoader:
        return self.attached.loader

    @property
    def planner(self) -> Planner:
        return self.attached.planner

    @property
    def scaler(self) -> LRScaler:
        return self.attached.scaler

    @property
    def precondition(self) -> Preconditioner:
        return self.attached.precondition

    # -- set-up ----------------------------------------------------------------------------------
    def _install_slowdown(self, module: nn.Module, slowdown: float | None,
                          profile: tuple[float, float]) -> Any:
        if slowdown is None and not os.environ.get(SLOWDOWN_ENV):
            return None
        from cannikin.runtime.emulate import install_slowdown, slowdown_from_env

        factor = slowdown_from_env(self.rank) if slowdown is None else float(slowdown)
        logger.info("emulating a device %.3gx slower than this one (rank %d)", factor,
                    self.rank)
        return install_slowdown(module, factor, fixed_s=profile[0], per_sample_s=profile[1])

    def _gather_identity(self, max_local_batch: int | Sequence[int | None] | None,
                         device_name: str | None, recover_backward_oom: bool | None,
                         ) -> tuple[tuple[int | None, ...], tuple[str, ...], bool, bool]:
        """Every rank's memory cap and device name, whether a backward's out-of-memory is
        recovered from, and whether any worker is on a GPU (one all-gather at start-up)."""
        if isinstance(max_local_batch, Sequence):
            if len(max_local_batch) != self.world_size:
                raise ValueError(f"max_local_batch has {len(max_local_batch)} entries, expected "
                                 f"one per worker ({self.world_size})")
            mine: int | None = max_local_batch[self.rank]
        else:
            mine = max_local_batch
        if mine is not None and (not isinstance(mine, int) or mine < 1):
            raise ValueError(f"max_local_batch must be an integer >= 1 or None, got {mine!r}")
        if device_name is None:
            device_name = (torch.cuda.get_device_name(self.device)
                           if self.device.type == "cuda" else "cpu")
            if self._emulation is not None:
                device_name += f"/slowdown={self._emulation.factor:g}"
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (mine, device_name, recover_backward_oom,
                                          self.device.type == "cuda"))
        asked = {g[2] for g in gathered} - {None}
        if len(asked) > 1:  # where the exchange rides must be the same on every rank
            raise ValueError(f"recover_backward_oom differs between ranks: "
                             f"{[g[2] for g in gathered]} (rank order); pass the same value "
                             f"on every rank")
        any_gpu = any(g[3] for g in gathered)
        recovers = asked.pop() if asked else _RESETTABLE and any_gpu
        if recovers and not _RESETTABLE:
            raise ValueError(f"recover_backward_oom=True needs torch >= 2.4 (its DDP reducer's "
                             f"reset after a failed backward); this is torch {torch.__version__}")
        return (tuple(g[0] for g in gathered), tuple(g[1] for g in gathered), recovers,
                any_gpu)

    # -- exposed state ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps taken through the loader (restored by a resume)."""
        return self._cycle.step

    @property
    def last_metrics(self) -> dict[str, Any]:
        """What the metrics sink got for the last step."""
        return self._cycle.last_metrics

    @property
    def module(self) -> nn.Module:
        """The user's model (save its state_dict)."""
        module: nn.Module = self.ddp.module
        return module

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """DDP's state dict (keys ``module.<name>``, as DistributedDataParallel's), so a
        checkpoint saved from either wrapper loads into the other; ``model.module`` has the
        plain module's keys."""
        return self.ddp.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load DDP-style keys (see :meth:`state_dict`)."""
        return self.ddp.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """DDP's names (``module.<name>``, as :meth:`state_dict`'s keys), so that a DDP
        script that picks parameters by name (its param groups, what it freezes) picks the
        same ones: under this wrapper's own names (``ddp.module.<name>``) a test such as
        ``name.startswith("module.encoder")`` would pick none, silently."""
        return self.ddp.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """DDP's names, as :meth:`named_parameters`."""
        return self.ddp.named_buffers(prefix, recurse, remove_duplicate)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """This wrapper, then the wrapped module's under DDP's names (``module.<name>``):
        a script that picks modules by name (the layers it adapts or prunes) picks the ones
        it picks under DistributedDataParallel, and :meth:`get_submodule` finds each."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if self in memo:
                return
            memo.add(self)
        yield prefix, self
        inner = f"{prefix}.module" if prefix else "module"
        yield from self.ddp.module.named_modules(memo, inner, remove_duplicate)

    def __getstate__(self) -> NoReturn:
        """Refused by name: a copy (``copy.deepcopy``, ``torch.save(model)``, swa_utils'
        ``AveragedModel(model)``) would copy the loader, the planner and the comm hook's
        state of a running job, and failed on a GradBucket."""
        raise TypeError(
            "a HeteroDataParallel cannot be copied or pickled: it holds the job's loader, "
            "planner and all-reduce state. Copy the plain module instead, "
            "AveragedModel(model.module) or copy.deepcopy(model.module) (its update from "
            "the wrapper, ema.update_parameters(model), takes the same parameters), and "
            "save model.state_dict() (DDP's keys) rather than the object")

    @property
    def plan(self) -> Plan:
        """The split in force: local batches and predicted step time (NaN before a model)."""
        record = self.planner.current
        pred = record.predicted_step_s
        return Plan(local_batches=record.local_batches,
                    step_time=math.nan if pred is None else pred)

    def pin_split(self, split: Sequence[int] | npt.NDArray[np.integer] | None) -> None:
        """Train with ``split`` (one local batch per rank, their sum the total batch) from
        the next step on, without re-planning, until ``pin_split(None)`` hands the split
        back to the planner. Every rank must pin the same split at the same step (the
        step's exchange refuses ranks whose splits differ). The gradient stays the exact
        mean over the step's samples; the pinned steps are measured, so
        :attr:`cluster_model` still learns from them. An out-of-memory releases the pin."""
        self.planner.pin(self._cycle.step, split)

    @property
    def plan_history(self) -> list[PlanRecord]:
        return self.planner.history

    @property
    def cluster_model(self) -> ClusterModel | None:
        return self.planner.cluster_model

    @property
    def prediction_tracker(self) -> PredictionTracker:
        return self.planner.tracker

    @property
    def noise_scale(self) -> float | None:
        return self.planner.noise.noise_scale()

    @property
    def total_batch(self) -> int:
        return self.planner.total_batch

    @property
    def step_share(self) -> float | None:
        """This rank's share b_i / B of the step in progress (handed out by the loader,
        its optimizer step not taken yet), None outside one: the weight of its local mean
        in the step's mean (a logged loss, say)."""
        cycle = self._cycle
        if not cycle.stepping or cycle.split is None:
            return None
        total = sum(cycle.split)
        return cycle.split[self.rank] / total if total else 0.0

    def split_for(self, total: int) -> tuple[int, ...]:
        return self.planner.split_for(total)

    @property
    def accumulates(self) -> bool:
        """Whether a step may take several passes (``max_micro_batches > 1``)."""
        return self.planner.config.accumulate

    def micro_sizes(self, batch: int) -> tuple[int, ...]:
        """This rank's micro-batches of a local batch of ``batch``."""
        return self.planner.passes(self.rank, batch)

    # -- the step ----------------------------------------------------------------------------------
    def begin_step(self, split: tuple[int, ...]) -> None:
        """The loader hands out this step's split: set the weight, reset the records."""
        cycle = self._cycle
        self._refuse_skipped_idle_backward("the next step")
        total = sum(split)
        self._buffer_source.rank = cycle.largest  # the step before's: its forward moved them most
        if not split[self.rank] and not cycle.said_idle and total == self.planner.total_batch:
            self._say_idle(split)
        cycle.split = split
        cycle.passes = self.micro_sizes(split[self.rank])
        cycle.pass_index = 0
        cycle.first_end = cycle.last_bwd_start = None
        # a forward between two steps (an evaluation), or a step that never reached the
        # optimizer (AMP's GradScaler skips the update when a gradient overflowed) lies
        # inside this step's cycle, which runs from the previous backward: this rank does
        # not measure it, and the planner skips a step some rank did not measure
        interrupted = cycle.interrupted or cycle.stepping
        if cycle.stepping and self.comm.rows_at_last:
            self._reset_after_unreached_oom()
        if cycle.stepping and cycle.planned_measuring and self.comm.backwards:
            # the step before trained, but without an optimizer step (not one of an
            # evaluation that iterates the loader: no backward)
            self._count_lost({UNSTEPPED}, measured=False)
        cycle.unmeasured_by = {FORWARD_BETWEEN} if cycle.forward_between else set()
        cycle.forward_between = cycle.trained_forward = False
        cycle.exchanges = cycle.planned_measuring or self.attached.exchange_every_step
        cycle.planned_measuring = self.planner.measures(cycle.step)
        cycle.measuring = cycle.planned_measuring and not interrupted
        cycle.whole, cycle.interrupted = not interrupted, False
        # the passes before the last accumulate; the last one's gradient holds the sum of
        # every pass's mean gradient weighted by its size over the last's (begin_pass), so
        # its bucket is scaled by last / B, and its |g|^2 by (last / b_i)^2
        last = cycle.passes[-1]
        self.comm.begin_step(last / total)
        self.comm.sqnorm_scale = last / split[self.rank] if split[self.rank] else 1.0
        cycle.norms = cycle.measuring and (self.attached.noise_decides
                                           or cycle.step % NORM_STRIDE == 0)
        self.comm.capture_sqnorm = cycle.norms
        self.comm.times_buckets = cycle.measuring
        cycle.largest = largest_batch_rank(split)
        self.comm.takes_global = cycle.largest == self.rank
        routes = self.attached.idle_routes
        self.comm.route = None if routes is None else routes.route(split)
        cycle.hook_free = self._runs_hook_free(split)
        cycle.reached = False
        if cycle.norms and len(cycle.passes) > 1:
            self.comm.watch_passes(list(self.ddp.module.parameters()), len(cycle.passes))
        else:
            self.comm.unwatch_passes()
        cycle.bwd_start = None
        cycle.oom = cycle.left_checked = False
        cycle.stepping = True
        if cycle.prev_mark is None:
            cycle.prev_mark = cycle.measure_from = self.clock.mark()
            cycle.prev_cpu = time.process_time()

    def _runs_hook_free(self, split: tuple[int, ...]) -> bool:
        """This step needs nothing of the comm hook, so it runs through the hook-free twin
        (:attr:`_Attached.twin`, made here the first time): nothing is measured or
        exchanged, and every worker runs one pass of the same batch, where DDP's mean of the
        ranks' gradients is the weighted mean (each weight 1 / n) whatever the backward.
        Every rank decides alike: from the split, the planner's cadence and every rank's
        passes."""
        cycle, parts = self._cycle, self.attached
        if (not self._options.hook_free or parts.exchange_every_step
                or cycle.planned_measuring or cycle.exchanges
                or not split[0] or any(b != split[0] for b in split)
                or any(len(self.planner.passes(rank, batch)) > 1
                       for rank, batch in enumerate(split))):
            return False
        if parts.twin is None:
            parts.twin = self._hook_free_twin()
        return True

    def _say_idle(self, split: tuple[int, ...]) -> None:
        """Once a run, where this rank is first planned no samples of a full step: what an
        empty local batch does to a script written for DDP's equal ones."""
        self._cycle.said_idle = True
        logger.warning(
            "rank %d has 0 samples from step %d (split %s). It still joins the all-reduce "
            "and the update, and the gradient stays the mean over the step's samples, but "
            "its forward runs on an empty batch: its mean loss is NaN (the mean of nothing), "
            "and a metric divided by its batch size divides by 0. Weigh logged values by "
            "model.step_share (0 here), or pass allow_idle=False (to HeteroDataParallel, "
            "CannikinStrategy or CannikinAccelerator) to keep every worker at 1 sample or more",
            self.rank, self._cycle.step, list(split))

    def begin_pass(self, index: int) -> None:
        """Pass ``index`` of the step's micro-batches is next: DDP all-reduces only after
        the last one's backward (its ``no_sync`` for the others; the buffers are broadcast
        at the first pass's forward alone, as DDP does under ``no_sync``). The gradient
        accumulated so far is rescaled by the previous pass's size over this one's, so
        that after the last pass it is ``sum_j (m_j / m_last) g_j``."""
        cycle = self._cycle
        passes = cycle.passes
        if not 0 <= index < len(passes):
            raise RuntimeError(f"pass {index} of a step of {len(passes)} micro-batches")
        cycle.pass_index = self.comm.pass_index = index
        self.ddp.require_backward_grad_sync = index == len(passes) - 1
        if index == 0:
            return
        if index == 1:
            cycle.first_end = self.clock.mark()
        if passes[index - 1] != passes[index]:  # every gradient DDP all-reduces
            ratio = passes[index - 1] / passes[index]
            with torch.no_grad():
                for p in self.ddp.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(ratio)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """DDP's forward, between the runtime's records of it. Under ``torch.compile(model)``
        those run as they are, outside the graph: dynamo compiles the model, and traced
        they recompiled on every change of the step's state until its limit."""
        ddp = self._before_forward()
        try:
            out = ddp(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            # recovered only on a step whose exchange can tell every rank: any step where
            # a worker is on a GPU (on a CPU-only job only a simulated one can happen)
            cycle = self._cycle
            if not (cycle.stepping and torch.is_grad_enabled() and cycle.exchanges):
                raise
            out = self._placeholder_after_oom(args, kwargs)
        except Exception as err:
            self._refuse_failed_empty_forward(err)
            raise
        self._after_forward(out)
        return out

    def end_epoch(self) -> None:
        """The loader's epoch ends: a rank planned 0 samples that skipped the backward of
        its last step would leave the loop while the others wait for its gradient."""
        self._refuse_skipped_idle_backward("the end of its epoch")

    def _refuse_skipped_idle_backward(self, went_on_to: str) -> None:
        """A rank planned 0 samples that trained a forward of its step and went on to
        ``went_on_to`` (the next step, its optimizer step, or the end of its epoch) without
        a backward raises, naming the cause: the others wait in the step's all-reduce for
        its gradient, and would wait until the collective timeout (or fail when it leaves)
        with an error that says nothing of why. Its mean loss is NaN (the mean of
        nothing), so a script that skips the backward on a non-finite local loss, or on
        an empty batch, skips it on this rank alone; under DDP no rank had an empty
        batch, and the same script ran."""
        cycle = self._cycle
        split = cycle.split
        if not (cycle.stepping and cycle.trained_forward and not self.comm.backwards
                and split is not None and split[self.rank] == 0):
            return
        raise RuntimeError(
            f"rank {self.rank} had 0 samples in step {cycle.step} (split {list(split)}) and "
            f"went on to {went_on_to} without a backward, while the other ranks wait for "
            f"its gradient in the step's all-reduce. Its mean loss is NaN (the mean of no "
            f"samples): a script that skips the backward on a non-finite local loss (`if "
            f"not torch.isfinite(loss): continue`) or on an empty batch skips it on this "
            f"rank alone. Run the backward and optimizer.step() on every rank (the idle "
            f"rank's gradient is zero and its update exact), decide a skip on the loss "
            f"weighed by model.step_share and all-reduced (the same on every rank), or pass "
            f"allow_idle=False (to HeteroDataParallel, CannikinStrategy or "
            f"CannikinAccelerator) to keep every worker at 1 sample or more")

    def _refuse_failed_empty_forward(self, err: Exception) -> None:
        """A forward that failed on this rank's empty local batch raises naming the cause
        and the option that avoids it: a model written for DDP's equal batches may not run
        on 0 samples, and its own error (a reshape, an empty reduction) did not say why the
        batch was empty. Any other failure is left as it is."""
        cycle = self._cycle
        if not (cycle.stepping and cycle.split is not None and cycle.split[self.rank] == 0):
            return
        raise RuntimeError(
            f"rank {self.rank}: the model's forward failed on this rank's empty local batch "
            f"(0 samples of the split {list(cycle.split)}: {type(err).__name__}: {err}). A "
            f"worker is planned 0 samples where the step is faster without its work; for a "
            f"model that cannot run on an empty batch pass allow_idle=False (to "
            f"HeteroDataParallel, CannikinStrategy or CannikinAccelerator), which keeps "
            f"every worker at 1 sample or more") from err

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _before_forward(self) -> DistributedDataParallel:
        """The step's records before the forward; the DDP to run it (the hook-free twin
        on a step that needs nothing of the hook)."""
        cycle = self._cycle
        if cycle.stepping:
            twin = self.attached.twin if cycle.hook_free else None
            return self.ddp if twin is None else twin
        cycle.interrupted = cycle.forward_between = True
        if self._parts is None and torch.is_grad_enabled() and not cycle.said_unattached:
            cycle.said_unattached = True
            logger.warning("HeteroDataParallel is not attached to an optimizer and a "
                           "loader: it trains as plain DDP (an even mean of the ranks' "
                           "gradients) until model.attach(optimizer, loader)")
        return self.ddp

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _after_forward(self, out: Any) -> None:
        cycle = self._cycle
        cycle.trained_forward |= (cycle.stepping and torch.is_grad_enabled()
                                  and self.module.training)
        at_start: list[Callable[[torch.Tensor], None]] = []  # run as the backward starts
        if cycle.stepping and torch.is_grad_enabled():
            unmarked = ((cycle.pass_index == 0 and cycle.bwd_start is None)
                        or (cycle.pass_index == len(cycle.passes) - 1
                            and cycle.last_bwd_start is None))
            if cycle.measuring and unmarked:
                at_start.append(self._mark_backward_start)
            if cycle.norms and len(cycle.passes) == 1:
                at_start.append(self._take_output_gradient)
            if cycle.pass_index == 0 and not cycle.left_checked and self._several_passes:
                at_start.append(self._refuse_gradients_left)
        tensor = _first_grad_tensor(out) if at_start else None
        if tensor is not None:
            for hook in at_start:
                tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        if cycle.stepping and cycle.hook_free and torch.is_grad_enabled():
            watched = False
            for output in _grad_tensors(out):  # any of them a loss may be made of
                output.register_hook(self._mark_reached)  # type: ignore[no-untyped-call]
                watched = True
            cycle.reached |= not watched  # an output of no type searched: DDP's word alone
        if cycle.stepping and cycle.exchanges and self.comm.rows is None:
            self.comm.rows = self._exchange_rows()  # sent with a gradient bucket

    def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None = None,
                 **kwargs: Any) -> None:
        """``loss.backward(gradient, **kwargs)``, the same gradients, with this rank's weight
        b_i / B in the backward's seed (onto cleared gradients, :meth:`_gradients_clear`):
        the hook then all-reduces the buckets as they are, where after a plain
        ``loss.backward()`` it scales every gradient once more (a pass over all of them:
        ~0.3 ms per step for 1.1 M float32 parameters on one CPU core, paid at the slowest
        worker's speed). See :meth:`weighted_backward` for where the hook scales as
        before, and for a CUDA out-of-memory in the backward, which does not reach the
        caller here (a plain ``loss.backward()`` gives autograd's exception no place to be
        caught: it still raises)."""
        with self.weighted_backward() as weight:
            if weight is None:
                loss.backward(gradient, **kwargs)  # type: ignore[no-untyped-call]
                return
            if gradient is None:
                if loss.numel() != 1:
                    raise RuntimeError(f"model.backward(loss) of a loss of shape "
                                       f"{tuple(loss.shape)}: a gradient is implied only for "
                                       f"a scalar loss (reduce it, or pass gradient=)")
                gradient = torch.ones_like(loss)
            loss.backward(gradient * weight, **kwargs)  # type: ignore[no-untyped-call]

    @contextmanager
    def weighted_backward(self) -> Iterator[float | None]:
        """For a backward that other code runs (Lightning's): yields the weight b_i / B to
        multiply the loss by, and the backward run inside takes the buckets as weighted
        already; or None, and the loss stays as it is (the hook weighs the buckets): outside
        a step of the loader, on a step of several micro-batches (their passes are weighed
        by size), on a rank with 0 samples (its bucket is zeroed: the mean loss of no
        samples is NaN), onto gradients left from before (:meth:`_gradients_clear`), and
        on a step through the hook-free twin (DDP's own mean is the weighted one there).

        A CUDA out-of-memory raised in the block (by the backward) does not leave it, with
        ``recover_backward_oom`` in a step of the loader: this rank launches the gradient
        all-reduces its backward did not reach, on zeros, with the exchange that flags the
        step, so every collective lines up; every rank then skips the step's update, this
        rank's cap is lowered and the step's samples come again
        (:meth:`_skip_step_after_oom`)."""
        cycle, weight = self._cycle, self.comm.weight
        seeded = (cycle.stepping and not cycle.hook_free and len(cycle.passes) == 1
                  and weight > 0.0 and self._gradients_clear(values=False))
        self.comm.seeded = seeded
        try:
            yield weight if seeded else None
        except torch.cuda.OutOfMemoryError as error:
            if not (cycle.stepping and self.comm.rows_at_last):
                raise
            self.comm.seeded = False  # the buckets launched now hold zeros
            self._recover_backward_oom(error)
        finally:
            self.comm.seeded = False

    def _gradients_clear(self, values: bool) -> bool:
        """No gradient is left in the parameters that DDP all-reduces: each is None (what
        ``optimizer.zero_grad()`` leaves by default) or, with ``values``, all zeros (its
        ``set_to_none=False``; a read of each gradient left, on a GPU one host
        synchronisation each). A backward onto gradients left there (a second backward in
        the step, a GAN's discriminator on real and then fake samples, or gradients summed
        over several of the loader's steps) must not be seeded: the all-reduce would sum
        the reduced gradient once per rank, where the hook's weights b_i / B, which sum to
        1, keep it once, as DDP's mean does."""
        left = [p.grad for p in self._trained if p.grad is not None]
        if not values:
            return not left
        return not any(bool(grad.detach().ne(0).any()) for grad in left)

    @property
    def _several_passes(self) -> bool:
        """A step may take several passes on some rank (every rank answers alike)."""
        return self.accumulates or (self.planner.config.micro_batches or 1) > 1

    def _refuse_gradients_left(self, grad: torch.Tensor) -> None:
        """At the start of the step's first backward (after a ``zero_grad()`` between the
        forward and the backward, as Lightning runs them): raise if a gradient is left from
        before the step. Its passes' rescaling (:meth:`begin_pass`) would weigh it wrongly,
        silently. Every rank checks, before any all-reduce of the step, so all raise alike."""
        cycle = self._cycle
        if cycle.left_checked:
            return
        cycle.left_checked = True
        if not self._gradients_clear(values=True):
            raise RuntimeError(
                f"rank {self.rank}: a step of a model that runs micro-batches began its "
                f"backward with gradients left from before it (no optimizer.zero_grad() "
                f"since the last step): its passes' rescaling would weigh them wrongly. Zero "
                f"the gradients before each step's first backward, and raise batch_size to "
                f"accumulate over more samples")

    def _mark_reached(self, grad: torch.Tensor) -> None:
        self._cycle.reached = True

    def _mark_backward_start(self, grad: torch.Tensor) -> None:
        cycle = self._cycle
        if cycle.pass_index == 0:
            if cycle.bwd_start is None:
                cycle.bwd_start = self.clock.mark()
        elif cycle.last_bwd_start is None:
            cycle.last_bwd_start = self.clock.mark()

    def _take_output_gradient(self, grad: torch.Tensor) -> None:
        """The loss check's figure of the step (:attr:`StepReport.output_grad`), left on the
        device: the median over this rank's samples of the norm of the loss's gradient at
        the model's output, those not 0 (NaN: fewer than ``MIN_SAMPLES`` of them), without
        the seed's weight. Nothing where the output has no row per sample (a loss the model
        computes itself)."""
        split = self._cycle.split
        batch = split[self.rank] if split else 0
        if (self.comm.output_grad is not None or batch == 0 or grad.dim() == 0
                or grad.shape[0] != batch or not grad.is_floating_point()):
            return
        norms = torch.linalg.vector_norm(grad.detach().reshape(batch, -1), dim=1).float()
        vanished = norms == 0
        median = torch.nanmedian(norms.masked_fill(vanished, math.nan))
        median = median.masked_fill((batch - vanished.sum()) < MIN_SAMPLES, math.nan)
        self.comm.output_grad = median / self.comm.weight if self.comm.seeded else median

    def _placeholder_after_oom(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Out of memory in forward: run two samples so every collective still lines up.

        The output is the first sample's, repeated to the local batch so the user's loss
        still computes; the step's update is skipped on every rank and the samples come
        again with a split under this rank's lowered cap (see
        :meth:`_before_optimizer_step`). Two samples, not one: BatchNorm refuses a single
        value per channel in training. DDP broadcast the buffers before the forward that
        failed, so the placeholder's forward must not broadcast them again: the peers
        would pair that broadcast with a gradient bucket's all-reduce and hang.
        """
        cycle = self._cycle
        batch = cycle.passes[cycle.pass_index] if cycle.passes else 0
        logger.warning("rank %d: out of memory in forward at a pass of %d samples", self.rank,
                       batch)
        self._mark_oom()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.ddp.require_forward_param_sync = False  # DDP's own forward sets it again
        out = self.ddp(*map_batched(args, lambda t: t[:2]),
                       **map_batched(kwargs, lambda t: t[:2]))
        return map_batched(out, lambda t: t[:1].expand(batch, *t.shape[1:]))

    def _mark_oom(self) -> None:
        """This rank ran out of memory in this step: its row of the exchange says so (made
        again if a micro-batch before made it: the rows are sent in the last one's backward)."""
        self._cycle.oom = True
        self.comm.rows = self._exchange_rows()

    def _recover_backward_oom(self, error: torch.cuda.OutOfMemoryError) -> None:
        cycle = self._cycle
        logger.warning("rank %d: out of memory in backward at a pass of %d samples", self.rank,
                       cycle.passes[cycle.pass_index])
        self._mark_oom()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not self.ddp.require_backward_grad_sync:
            return  # a micro-batch before the last (DDP's no_sync): nothing was all-reduced
        buckets = self.ddp.reducer._get_zeros_like_grad_buckets()
        if len(self.comm.reductions) >= len(buckets):
            raise RuntimeError(
                f"rank {self.rank}: out of memory in backward after all {len(buckets)} "
                f"gradient buckets were all-reduced (the exchange, which rides the last, said "
                f"nothing of it): the other workers take the step, so it cannot be redone"
            ) from error
        finish_failed_backward(self.comm, buckets)
        if self.ddp.find_unused_parameters and not self.ddp.static_graph:
            # DDP all-reduces which parameters were used after the last bucket
            dist.all_reduce(self.ddp.reducer._get_local_used_map(),
                            group=self.ddp.process_group)

    def _measure(self, step_s: float, cpu_s: float, readout: StepReadout,
                 global_sqnorm: float | None) -> StepReport:
        """This rank's measurements of the step just finished (its measured period
        ``step_s``, from ``measure_from``; the process's CPU seconds in it ``cpu_s``)."""
        cycle = self._cycle
        clock, comm = self.clock, self.comm
        prev = cycle.measure_from

        def at(mark: Any, otherwise: float) -> float:
            return otherwise if mark is None else clock.elapsed(prev, mark)

        ready = [clock.elapsed(prev, m) for m in comm.ready]
        done = [clock.elapsed(prev, m) for m in comm.done if m is not None]
        # the buckets are the last pass's; F and K are timed on the first pass, which
        # starts where a step of one pass does (a missing output hook, as with a loss not
        # built from the output: from the first bucket, or where the first pass ended)
        several = len(cycle.passes) > 1
        tail_start = at(cycle.last_bwd_start if several else cycle.bwd_start,
                        ready[0] if ready else step_s)
        last = ready[-1] if ready else tail_start
        tail = max(last - tail_start, 0.0)
        start = at(cycle.bwd_start, at(cycle.first_end, tail_start)) if several else tail_start
        bwd = max(at(cycle.first_end, tail_start) - start, 0.0) if several else tail
        fractions = [min(max((r - tail_start) / tail, 0.0), 1.0) if tail > 0 else 1.0
                     for r in ready]
        allreduce = []
        previous_done = 0.0
        for r, d in zip(ready, done, strict=False):
            allreduce.append(max(d - max(r, previous_done), 0.0))
            previous_done = d
        if len(allreduce) != len(fractions):
            fractions, allreduce = [], []
        report = StepReport(batch=cycle.split[self.rank] if cycle.split else 0,
                            timed_batch=cycle.passes[0] if several else None,
                            sqnorm=readout.local_sqnorm, pass_sqnorms=readout.pass_sqnorms,
                            output_grad=readout.output_grad,
                            fwd_s=start, bwd_s=bwd, step_s=step_s,
                            ready_fractions=tuple(fractions), allreduce_s=tuple(allreduce),
                            cpu_s=cpu_s, cpu_cores=self.cpu_cores, plan_s=cycle.plan_s,
                            global_sqnorm=global_sqnorm)
        return report

    def _exchange_rows(self) -> np.ndarray:
        """The per-step exchange: this rank's row (this step's batch and OOM flag, the
        previous step's measurements), zeros elsewhere; summed over ranks it is every
        rank's row, an all-gather in one all-reduce."""
        report = WorkerReport(batch=self._cycle.split[self.rank] if self._cycle.split else 0,
                              oom=self._cycle.oom, previous=self._cycle.previous)
        rows = np.zeros((self.world_size, REPORT_SIZE))
        rows[self.rank] = report.to_vector()
        return rows

    def _exchange(self, rows: np.ndarray | None) -> list[WorkerReport]:
        """Every rank's report of this step, from the ``rows`` that rode with a gradient
        bucket (summed over ranks), or exchanged now if no bucket carried them."""
        if rows is None:  # no gradient bucket this step: on its own
            alone = torch.from_numpy(self._exchange_rows()).to(self.device)
            dist.all_reduce(alone)
            rows = alone.cpu().numpy()
        return [WorkerReport.from_vector(row) for row in rows.tolist()]

    def _global_sqnorm(self, measured: float | None) -> float:
        """This rank's share of |g|^2 of the all-reduced gradient, in the noise scale's
        space (:attr:`StepReport.global_sqnorm`): 0 where another rank takes it; as the
        hook took it (``measured``), or from the gradients if no bucket reached the hook."""
        if not self.comm.takes_global:
            return 0.0
        if measured is not None:
            return measured
        total = 0.0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = self.precondition(p, p.grad).reshape(-1)
                    total += float(torch.dot(g, g))
        return total

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        cycle = self._cycle
        if not cycle.stepping or cycle.split is None:
            return  # a step outside HeteroDataLoader's iteration: plain DDP (see _end_step)
        if cycle.pass_index != len(cycle.passes) - 1:
            raise RuntimeError(
                f"rank {self.rank}: optimizer.step() after {cycle.pass_index + 1} of the "
                f"step's {len(cycle.passes)} micro-batches: run forward and backward on every "
                f"micro-batch of `for x, y in step` before the optimizer step (the gradient "
                f"is all-reduced after the last one only)")
        # torch hands the step's own arguments, the optimizer first
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if not (cycle.reached if cycle.hook_free else self.comm.backwards):
            if closure is None:
                self._refuse_skipped_idle_backward("its optimizer step")
                self._refuse_unreduced_gradients()
            else:  # its passes run after this hook
                cycle.measuring = False
                cycle.unmeasured_by.add(CLOSURE)
        end, cpu = self.clock.mark(), time.process_time()
        if self.comm.backwards > 1:  # its records hold every backward's: not one step's
            cycle.measuring = False
            cycle.unmeasured_by.add(SEVERAL_BACKWARDS)
        if cycle.planned_measuring:
            self._count_lost(cycle.unmeasured_by, measured=cycle.measuring)
        # the step's one read from the device; on a GPU every mark is complete after it,
        # so the timings below wait for nothing
        readout = self.comm.read_step(cycle.measuring and cycle.norms)
        step_s = self.clock.elapsed(cycle.prev_mark, end)
        report = None
        if cycle.measuring:
            global_sqnorm = self._global_sqnorm(readout.global_sqnorm) if cycle.norms else None
            report = self._measure(self.clock.elapsed(cycle.measure_from, end),
                                   cpu - cycle.prev_cpu, readout, global_sqnorm)
        if cycle.exchanges:
            reports = self._exchange(readout.rows)
            self.collective_timeout.observe(reports)
            planned = tuple(r.batch for r in reports)
            if planned != cycle.split:
                raise RuntimeError(f"rank {self.rank} planned split {list(cycle.split)} but "
                                   f"the workers ran {list(planned)}: the ranks' plans diverged")
        else:  # nothing to report: no worker measured the step before
            reports = [WorkerReport(batch=b, oom=False, previous=None) for b in cycle.split]
        stall_s = cycle.plan_s  # this rank's re-plan before the step, in its period
        cycle.prev_mark = cycle.measure_from = end
        cycle.prev_cpu, cycle.plan_s = cpu, 0.0
        cycle.scaled = False
        if any(r.oom for r in reports):
            cycle.previous = None  # an out-of-memory step's measurements say nothing
            self._skip_step_after_oom(reports)
            return
        predicted = self.planner.predicted(cycle.split)
        self.planner.observe(cycle.step, reports, _summed_global_sqnorm(reports))
        if cycle.whole:
            self.planner.time_step(cycle.split, step_s, stall_s)
        self._follow_preconditioner()
        cycle.previous = report
        noise = self.planner.noise
        total = sum(cycle.split)
        factor = self.scaler.step_begin(total, noise.grad_sqr, noise.grad_var)
        cycle.scaled = True
        cycle.last_metrics = {
            "step": cycle.step, "epoch": self.loader.epoch, "local_batches": list(cycle.split),
            "total_batch": total, "step_time_s": step_s,
            "predicted_step_time_s": predicted, "lr_factor": factor,
            "noise_scale": noise.noise_scale(), "measured": report is not None,
            "fwd_s": None if report is None else report.fwd_s,
            "bwd_s": None if report is None else report.bwd_s,
            "cpu_s": None if report is None else report.cpu_s, "trained": total,
            "costly_workers": [{"rank": w.rank, "cost_s": w.cost_s, "speedup": w.speedup}
                               for w in self.planner.current.costly],
        }
        if self.planner.due(cycle.step):
            self._replan("cadence")

    def _refuse_unreduced_gradients(self) -> None:
        """No backward of this step reached DDP's last all-reduce, yet there are gradients: a
        loss made by ``model.module(x)`` (no DDP forward, so no all-reduce), or by another
        model; or a trained parameter that got no gradient, so that DDP never launched the
        last bucket (a layer the forward skipped, without ``find_unused_parameters``; plain
        DDP says so at the next forward, after an update on local gradients). Each rank
        would step on its own gradient and the replicas drift apart, silently. Raised
        before the update; every rank running the same script raises alike."""
        if self._gradients_clear(values=False):
            return
        skipped = ("some trained parameter got no gradient in this step's backward, so DDP "
                   "never launched its last gradient bucket (a layer the forward skipped: "
                   "pass find_unused_parameters=True to HeteroDataParallel, as with DDP)")
        if self.comm.reductions:  # some buckets went, the last never did
            cause = f"a backward went through this model's forward, but {skipped}"
        else:
            cause = (f"no backward of this step went through this model's forward (a loss "
                     f"made by model.module(x) runs no DDP forward: make it with model(x); "
                     f"model.module(x) is for a forward whose gradients the step drops, a "
                     f"GAN generator's step through its discriminator), or {skipped}")
        raise RuntimeError(
            f"rank {self.rank}: the optimizer step's gradients were never all-reduced: "
            f"{cause}. Each rank would update with its own gradient and the replicas would "
            f"drift apart")

    def _count_lost(self, causes: set[str], measured: bool) -> None:
        """:meth:`LostSteps.count` this step, unless the hooks were removed (not planning)."""
        if not self._removed:
            self._cycle.lost.count(causes, measured, self.rank, self._cycle.split)

    def _follow_preconditioner(self) -> None:
        """When Adam's preconditioning starts (after its warm-up), this step's norms are the
        first in the new space: the noise scale forgets the raw-gradient steps, all of which
        it has seen by now (the exchange is one step late). Every rank's optimizer state
        has the same step counts, so every rank resets at the same step; a run resumed past
        the warm-up keeps its restored noise scale."""
        cycle = self._cycle
        if not self.precondition.adaptive or cycle.preconditioned:
            return
        active = self.precondition.active
        if active and cycle.preconditioned is False:
            logger.info("step %d: Adam's preconditioning starts; the noise scale starts over",
                        cycle.step)
            self.planner.noise.reset()
        cycle.preconditioned = active

    def _replan(self, reason: str) -> None:
        """Re-plan after this step, and start the next step's measured period after it
        (:attr:`_Cycle.measure_from`)."""
        start = time.perf_counter()
        # a CPU limit may change while the job runs (docker update --cpus, an in-place
        # resize of a Kubernetes pod): ~0.2 ms of CPU, once a re-plan
        self.cpu_cores = own_cpu_limit()
        self.planner.replan(self._cycle.step, reason, share=self._share_decision)
        cycle = self._cycle
        cycle.plan_s = time.perf_counter() - start
        cycle.measure_from, cycle.prev_cpu = self.clock.mark(), time.process_time()

    def _share_decision(self, decide: Callable[[], Decision]) -> Decision:
        """Run ``decide`` on the rank that decides for all (:attr:`Planner.decider`, the
        most CPU) and broadcast its choice: the others wait for the fastest rank's choice
        instead of each making its own at its own speed. A choice that raises is sent as
        ``failed``, so the others raise too instead of waiting for a broadcast."""
        if self.world_size == 1:
            return decide()
        decider = self.planner.decider
        if self.rank == decider:
            try:
                decision = decide()
            except Exception:
                self._broadcast_decision(Decision.failed(self.world_size).to_vector(), decider)
                raise
            vector = decision.to_vector()
        else:
            vector = np.zeros(Decision.size(self.world_size))
        return Decision.from_vector(self._broadcast_decision(vector, decider))

    def _broadcast_decision(self, vector: np.ndarray, source: int) -> np.ndarray:
        sent = torch.from_numpy(vector).to(self.device)
        dist.broadcast(sent, src=source)
        return sent.cpu().numpy()

    def _skip_step_after_oom(self, reports: Sequence[WorkerReport]) -> None:
        for rank, r in enumerate(reports):
            if r.oom:  # the largest pass is the one that did not fit
                self.planner.lower_cap(rank, self.planner.passes(rank, r.batch)[0])
        self._replan("out of memory")
        if self.comm.rows_at_last:
            # a backward that ran out of memory left that rank's DDP reducer mid-step. Every
            # rank resets its own, at the same step: a reset reducer rebuilds its buckets
            # after the next backward, and the rebuild is collective
            self.ddp.reducer._reset_state()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # optimizers skip parameters without a gradient
        self.loader.rewind()
        self._cycle.last_metrics = {"step": self._cycle.step, "skipped": "out of memory",
                             "local_batches": [r.batch for r in reports],
                             "total_batch": sum(r.batch for r in reports), "trained": 0}

    def _reset_after_unreached_oom(self) -> None:
        """The step before never reached the optimizer (AMP's GradScaler skipped it: its
        gradient overflowed). If a rank ran out of memory in its backward, that rank's DDP
        reducer was left mid-step: reset, as :meth:`_skip_step_after_oom` does. Every rank
        decides alike, on the exchange that rode the step's gradient."""
        rows = self.comm.read_step(norms=False).rows
        if rows is not None and any(WorkerReport.from_vector(r).oom for r in rows.tolist()):
            self.ddp.reducer._reset_state()

    def _end_step(self) -> None:
        """Back to plain DDP semantics until the loader hands out the next step: a backward
        outside the loader's iteration (a step on the script's own tensors) averages the
        ranks' gradients, as DDP does, instead of weighing them by a stale b_i / B."""
        self._cycle.stepping = self._cycle.hook_free = False
        self.ddp.require_backward_grad_sync = True
        self.comm.weight = 1.0 / self.world_size
        self.comm.sqnorm_scale = 1.0
        self.comm.capture_sqnorm = self.comm.times_buckets = False
        self.comm.unwatch_passes()
        self.comm.rows = None

    def abandon_step(self) -> bool:
        """The loader's iteration was dropped after handing out a step that never reached
        the optimizer (a peek at a batch): the loader gives its samples back, and the next
        step, whose cycle spans the pause, is not measured."""
        if not self._cycle.stepping:
            return False
        self._end_step()
        self._cycle.interrupted = True
        return True

    def no_sync(self) -> Any:
        """Refused: accumulating gradients over several of the loader's steps would weigh
        the sum by the last step's b_i / B alone, a silently wrong gradient."""
        raise RuntimeError(
            "HeteroDataParallel does not accumulate gradients over loader steps: each "
            "step's local batches are weighted by their own b_i / B, which no_sync() would "
            "mix up. Use a larger batch_size (the total over all workers) with "
            "max_local_batch= (each worker's memory cap) and max_micro_batches= (passes "
            "beyond it), and iterate loader.steps()")

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        cycle = self._cycle
        if not cycle.stepping:
            return
        self._refuse_skipped_idle_backward("its optimizer step")  # a closure's, run in it
        self._end_step()
        if not cycle.scaled:
            return  # skipped step (out of memory): retried with the new split
        self.scaler.step_end()
        if self.rank == 0 and self.metrics is not None:
            self.metrics.log(dict(cycle.last_metrics), cycle.step)
        cycle.step += 1

    # -- checkpoint state ----------------------------------------------------------------------
    def runtime_state_dict(self) -> dict[str, Any]:
        """Planner (fitted models, total batch, noise scale), LR scaler, step: plain numbers."""
        return {"version": _STATE_VERSION, "step": self._cycle.step,
                "planner": self.planner.state_dict(), "lr_scaler": self.scaler.state_dict()}

    def load_runtime_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`runtime_state_dict`, possibly from a run with another world size
        (re-plans at once when every worker's device has a cached model)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"runtime state version {state.get('version')!r} is not supported "
                             f"(expected {_STATE_VERSION})")
        self._cycle.step = int(state["step"])
        self.planner.load_state_dict(state["planner"])
        self.scaler.load_state_dict(state["lr_scaler"])
        self._cycle.prev_mark = None  # the first step after a resume must not time the load

    def training_state_dict(self) -> dict[str, Any]:
        """Everything this rank's job needs to resume: the model's and optimizer's state
        dicts, the loader's position and :meth:`runtime_state_dict`. Rank-independent, so
        one rank's copy restores every rank (save it with
        :func:`cannikin.runtime.checkpoint.save_training`)."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(), "runtime": self.runtime_state_dict()}

    def load_training_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`training_state_dict` (every rank loads the same state)."""
        missing = {"model", "optimizer", "loader", "runtime"} - set(state)
        if missing:
            raise ValueError(f"training state lacks {sorted(missing)}; got keys {sorted(state)}")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.load_runtime_state_dict(state["runtime"])

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own part of a checkpoint: the last step's measurements, which the
        per-step exchange carries only with the next step. Restored on a resume with the
        same workers, the planner and the noise scale see every step as without a restart."""
        cycle = self._cycle
        return {"previous": None if cycle.previous is None else cycle.previous.to_vector()}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's :meth:`rank_state_dict` (only with the world size that saved
        it). One saved before the ranks' reports carried their shares of |g|^2 restores
        without the noise scale's next update."""
        previous = state["previous"]
        self._cycle.previous = None if previous is None else StepReport.from_vector(previous)

    def remove_hooks(self) -> None:
        """Detach from the optimizer and remove the emulation (the model stays wrapped)."""
        self._removed = True
        if self._parts is not None:
            for handle in self._parts.hooks:
                handle.remove()
        if self._emulation is not None:
            self._emulation.remove()
