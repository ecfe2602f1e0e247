"""torchrun worker for tests/test_runtime_dist.py: one launch runs many checks.

Usage: ``torchrun --standalone --nproc-per-node=3 runtime_checks.py OUT_JSON check ...``.
Every rank runs every named check in order; rank 0 writes ``{check: figures}`` to
OUT_JSON. Checks return numbers and the pytest side asserts on them, so a failure
message shows the measured figure. The group is gloo unless ``CANNIKIN_CHECK_BACKEND``
names another; checks named ``cuda_*`` run the check of the rest of the name on the GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel

from cannikin.log import setup_logging
from cannikin.runtime import HeteroDataLoader, HeteroDataParallel, parallel
from cannikin.runtime.comm import CommState, weighted_allreduce_hook
from cannikin.runtime.distributed import init_distributed
from cannikin.runtime.parallel import NORM_STRIDE
from cannikin.runtime.step_timeout import StepTimeout, TimeoutRule, group_timeout_s
from cannikin.runtime.timing import CpuClock
from hf_like import ModelOutputLike

SPLITS = [(3, 11, 50), (50, 3, 11), (0, 30, 34)]  # uneven, permuted, and one empty worker
CPU = torch.device("cpu")
IN, OUT = 8, 5


def _data(step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(total, IN, generator=gen), torch.randint(0, OUT, (total,), generator=gen)


class Unused(nn.Module):
    """A model with a parameter that never receives a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, 16)
        self.b = nn.Linear(16, OUT)
        self.unused = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, OUT))


def _bn() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, OUT))


def _local_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if len(x) == 0:  # an empty local batch still joins the collectives
        return model(x).sum() * 0.0
    return F.cross_entropy(model(x), y)


def _grad_check(make: Callable[[], nn.Module], *, per_chunk_reference: bool,
                unused: bool = False, hooked: bool = True, dtype: torch.dtype = torch.float32,
                exchange: np.ndarray | None = None) -> dict[str, Any]:
    """Max |grad - reference| / max |reference| over SPLITS, one optimizer-free step each.

    Every other step the hook also takes |g_i|^2 and |g|^2 (as on the runtime's measured
    steps); ``sqnorm_err`` is their largest relative error against this rank's local
    gradient and the reference gradient, computed in one process.

    With ``exchange`` (float64, one row per rank) each step also sends this rank's row,
    scaled by the step number, through the hook, and reports the largest relative error
    of the sum that comes back and how it travelled.
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = make().to(dtype)
    ref = copy.deepcopy(net)
    ddp = DDP(net, find_unused_parameters=unused)
    state = CommState(clock=CpuClock())
    if hooked:
        ddp.register_comm_hook(state, weighted_allreduce_hook)
    worst = rows_err = sqnorm_err = 0.0
    paths = []
    for step, split in enumerate(SPLITS):
        total = sum(split)
        x, y = _data(step, total)
        x = x.to(dtype)
        lo = sum(split[:rank])
        xs, ys = x[lo:lo + split[rank]], y[lo:lo + split[rank]]
        state.begin_step(split[rank] / total)
        state.capture_sqnorm = step % 2 == 0
        if exchange is not None:
            state.rows = np.zeros_like(exchange)
            state.rows[rank] = exchange[rank] * (step + 1)
        ddp.zero_grad(set_to_none=False)
        _local_loss(ddp, xs, ys).backward()
        if exchange is not None:
            expected = exchange * (step + 1)
            got = state.read_step(norms=False).rows
            assert got is not None, "the exchange rows were not sent"
            rows_err = max(rows_err, float((abs(got - expected) / abs(expected)).max()))
            paths.append("own collective" if state.rows_alone is not None else
                         f"tail of bucket {state.carrier_slot}")
        if hooked and state.capture_sqnorm and split[rank] > 0:
            ref.zero_grad(set_to_none=False)
            F.cross_entropy(ref(xs), ys).backward()  # this rank's local mean gradient
            local_sq = state.read_step(norms=True).local_sqnorm
            sqnorm_err = max(sqnorm_err, _relative(local_sq, _sqnorm(ref)))
        ref.zero_grad(set_to_none=False)
        if per_chunk_reference:  # BatchNorm statistics of each worker's own chunk
            bounds = [sum(split[:i]) for i in range(len(split) + 1)]
            out = torch.cat([ref(x[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)
                             if b > a])
            F.cross_entropy(out, y).backward()
        else:
            F.cross_entropy(ref(x), y).backward()
        pairs = [(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters(),
                                                  strict=True) if q.grad is not None]
        # relative to the largest reference entry: a parameter whose true gradient is ~0
        # (a bias feeding BatchNorm) must not turn rounding noise into a huge ratio
        scale = max(float(q.abs().max()) for _, q in pairs)
        worst = max(worst, max(float((p - q).abs().max()) for p, q in pairs) / scale)
        if hooked and state.capture_sqnorm:
            measured = state.read_step(norms=True).global_sqnorm
            assert measured is not None, "the hook did not take |g|^2"
            sqnorm_err = max(sqnorm_err, _relative(measured, _sqnorm(ref)))
        elif hooked:
            unmeasured = state.read_step(norms=True)
            assert (unmeasured.local_sqnorm, unmeasured.global_sqnorm) == (0.0, None)
            assert unmeasured.pass_sqnorms == ()
    figures = {"rel_err": worst, "sqnorm_err": sqnorm_err}
    if exchange is None:
        return figures
    return {**figures, "rows_err": rows_err, "paths": paths, "sizes": state.sizes}


def _sqnorm(model: nn.Module) -> float:
    return sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
               if p.grad is not None)


def _relative(got: float, expected: float) -> float:
    return abs(got - expected) / max(abs(expected), 1e-30)


def check_grad_mlp() -> dict[str, float]:
    return _grad_check(_mlp, per_chunk_reference=False)


def _wide() -> nn.Module:
    """Two buckets after DDP's rebuild in float32 and float64 (the first, ready first, is
    the larger), one in bfloat16."""
    return nn.Sequential(nn.Linear(IN, 600), nn.Tanh(), nn.Linear(600, 600), nn.Tanh(),
                         nn.Linear(600, OUT))


def check_exchange() -> dict[str, Any]:
    """The per-step exchange rows through the hook, for each bucket dtype: their sum over
    ranks comes back (riding the smallest bucket, or on their own where the dtype cannot
    carry float64) and the gradient is still the single-process one."""
    gen = torch.Generator().manual_seed(7)
    world = dist.get_world_size()
    magnitudes = 10.0 ** torch.randint(-30, 31, (world, 41), generator=gen).double()
    exchange = (torch.randn(world, 41, generator=gen, dtype=torch.float64)
                * magnitudes).numpy()
    return {str(dtype).removeprefix("torch."): _grad_check(_wide, per_chunk_reference=False,
                                                           dtype=dtype, exchange=exchange)
            for dtype in (torch.float32, torch.float64, torch.bfloat16)}


def check_grad_plain_ddp() -> dict[str, float]:
    """Plain DDP averaging on the same uneven splits: must be visibly wrong."""
    return _grad_check(_mlp, per_chunk_reference=False, hooked=False)


def check_grad_unused() -> dict[str, float]:
    return _grad_check(Unused, per_chunk_reference=False, unused=True)


def check_grad_batchnorm() -> dict[str, float]:
    return _grad_check(_bn, per_chunk_reference=True)


def check_batchnorm() -> dict[str, Any]:
    """A model with BatchNorm: its running statistics are those of the rank with the most
    samples (DDP's rank 0 held at 0 samples froze them for every rank), and no worker is
    planned a single sample, which BatchNorm refuses in training."""
    data = _blobs(240)
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 4))  # BatchNorm sees the data
    ref = copy.deepcopy(net[0])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = HeteroDataLoader(data, batch_size=60, seed=2)
    model = HeteroDataParallel(net, opt, loader, split="optimal", slowdown=None)
    world = dist.get_world_size()
    pinned = [0, 20, 40][:world]
    pinned[-1] += 60 - sum(pinned)
    model.pin_split(pinned)
    largest = max(range(world), key=lambda r: (pinned[r], -r))
    for x, y, idx in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, idx.tolist())
        ref(data.tensors[0][everyone[largest]])  # the largest local batch's update, alone
    model.eval()
    with torch.no_grad():
        model(data.tensors[0][:8])  # DDP's buffer broadcast before a forward
    model.train()
    stats_err = max(float((mine - want).abs().max()) for mine, want in (
        (net[0].running_mean, ref.running_mean), (net[0].running_var, ref.running_var)))
    moved = float(ref.running_mean.abs().max())
    min_local = model.planner.config.min_local
    twin = model.attached.twin is not None  # never an even split: no hook-free step
    model.remove_hooks()
    try:
        small = HeteroDataParallel(nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8)),
                                   slowdown=None)
        small_net = small.module
        small.attach(torch.optim.SGD(small_net.parameters(), lr=0.1),
                     HeteroDataLoader(data, batch_size=2 * world - 1, seed=2))
        refused = "allowed"
    except ValueError as error:
        refused = str(error)
    return {"stats_err": stats_err, "moved": moved, "min_local": min_local,
            "refused": refused, "twin": twin}


def check_idle_worker() -> dict[str, Any]:
    """Rank 0 pinned at 0 samples: it says once what an empty batch means for the script,
    and the loss the README logs (each rank's weighed by its share, the idle rank's NaN
    left out) is the step's mean loss. ``allow_idle=False`` reaches the planner."""
    world = dist.get_world_size()
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = HeteroDataLoader(_blobs(240), batch_size=60, seed=2)
    model = HeteroDataParallel(net, opt, loader, split="optimal", slowdown=None)
    pinned = [0, 20, 40][:world]
    pinned[-1] += 60 - sum(pinned)
    model.pin_split(pinned)
    logged_err = 0.0
    with _KeptWarnings().keep("cannikin.runtime.parallel") as warnings:
        for _ in range(2):
            for x, y, _ in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                share = model.step_share
                logged = loss.detach() * share if share else torch.zeros_like(loss)
                dist.all_reduce(logged)
                opt.step()
                losses: list[Any] = [None] * world
                dist.all_gather_object(losses, float(loss))
                want = sum(b * value for b, value in zip(pinned, losses, strict=True) if b) / 60
                logged_err = max(logged_err, abs(float(logged) - want) / want)
    model.remove_hooks()
    said = [w for w in warnings if "has 0 samples" in w]
    busy = HeteroDataParallel(_classifier(), slowdown=None, allow_idle=False)
    busy_net = busy.module
    busy.attach(torch.optim.SGD(busy_net.parameters(), lr=0.1),
                HeteroDataLoader(_blobs(240), batch_size=60, seed=2))
    allow_zero = busy.planner.config.allow_zero
    busy.remove_hooks()
    return {"logged_err": logged_err, "said": said, "allow_zero": allow_zero,
            "loss_nan": math.isnan(float(loss))}


class _NeedsSamples(nn.Module):
    """A classifier whose forward refuses an empty batch, as some models' code does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _classifier()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not len(x):
            raise ValueError("expected a batch of at least one sample")
        out: torch.Tensor = self.net(x)
        return out


def check_empty_forward() -> dict[str, Any]:
    """Rank 0 pinned at 0 samples, with a model that refuses an empty batch: its forward
    raises naming the empty batch and allow_idle=False, from the model's own error; the
    busy ranks' forwards run. No backward follows (it would wait for rank 0)."""
    world = dist.get_world_size()
    net = _NeedsSamples()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = HeteroDataLoader(_blobs(240), batch_size=60, seed=2)
    model = HeteroDataParallel(net, opt, loader, split="optimal", slowdown=None)
    model.pin_split([0, *([60 // (world - 1)] * (world - 1))])
    error, cause = None, None
    for x, _, _ in loader:
        try:
            model(x)
        except RuntimeError as err:
            error, cause = str(err), repr(err.__cause__)
        break
    model.remove_hooks()
    return {"error": error, "cause": cause}


def check_syncbn() -> dict[str, float]:
    """SyncBatchNorm over uneven counts: batch statistics, outputs and running stats
    equal one BatchNorm over the concatenated batch. torch's SyncBatchNorm runs on GPU
    only; all ranks share cuda:0 over gloo. The gradient error is reported, not
    asserted: bucket weighting is exact only where backward has no cross-worker term.
    """
    rank = dist.get_rank()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    ref = _bn().to(dev)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    ddp = DDP(net, device_ids=[0])
    state = CommState(clock=CpuClock())
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    out_err = stat_err = grad_err = 0.0
    for step, split in enumerate(SPLITS):
        total = sum(split)
        x, y = (t.to(dev) for t in _data(step, total))
        lo = sum(split[:rank])
        xs, ys = x[lo:lo + split[rank]], y[lo:lo + split[rank]]
        state.begin_step(split[rank] / total)
        ddp.zero_grad(set_to_none=False)
        out = ddp(xs)
        (F.cross_entropy(out, ys) if len(xs) else out.sum() * 0.0).backward()
        ref.zero_grad(set_to_none=False)
        ref_out = ref(x)
        F.cross_entropy(ref_out, y).backward()
        if len(xs):
            out_err = max(out_err, float((out - ref_out[lo:lo + len(xs)]).abs().max()))
        for a, b in ((net[1].running_mean, ref[1].running_mean),
                     (net[1].running_var, ref[1].running_var)):
            stat_err = max(stat_err, float((a - b).abs().max()))
        pairs = [(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters(),
                                                  strict=True)]
        scale = max(float(q.abs().max()) for _, q in pairs)
        grad_err = max(grad_err, max(float((p - q).abs().max()) for p, q in pairs) / scale)
    return {"out_err": out_err, "stat_err": stat_err, "grad_rel_err": grad_err}


def _train_through(model: HeteroDataParallel, opt: torch.optim.Optimizer,
                   loader: HeteroDataLoader, last: int) -> None:
    """Train the blobs classifier through step ``last`` (0-based) of ``loader``."""
    for step, (x, y, _) in enumerate(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step == last:
            break


def _blobs(n: int, features: int = 16, classes: int = 4) -> torch.utils.data.TensorDataset:
    """A learnable classification set; the third tensor is each sample's index."""
    gen = torch.Generator().manual_seed(7)
    centers = torch.randn(classes, features, generator=gen) * 2.0
    y = torch.randint(0, classes, (n,), generator=gen)
    x = centers[y] + torch.randn(n, features, generator=gen)
    return torch.utils.data.TensorDataset(x, y, torch.arange(n))


def _classifier(features: int = 16, classes: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))


class Recorder:
    """A metrics sink that keeps every record."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append({**metrics, "logged_step": step})


def _all_indices(seen: list[int]) -> list[int]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return sorted(i for part in everyone for i in part)


def _cuda() -> torch.device:
    """This rank's GPU: its own under nccl, the shared cuda:0 under gloo."""
    return torch.device("cuda", torch.cuda.current_device())


def _timings(rows: list[dict[str, Any]]) -> list[list[float]]:
    """(step, forward, backward) seconds of each measured step, as the clock took them."""
    return [[r["step_time_s"], r["fwd_s"], r["bwd_s"]] for r in rows if r["measured"]]


def _gradient_error(net: nn.Module, ref: nn.Module, data: torch.utils.data.TensorDataset,
                    idx: torch.Tensor, device: torch.device) -> float:
    """Largest difference between ``net``'s gradient and one process's (``ref``) over the
    step's samples (every rank's ``idx``), relative to the largest gradient value."""
    return _union_error(net, ref, data, [(idx, 1.0)], device)


def _union_error(net: nn.Module, ref: nn.Module, data: torch.utils.data.TensorDataset,
                 losses: list[tuple[torch.Tensor, float]],
                 device: torch.device = CPU) -> float:
    """``net``'s gradient against one process's (``ref``) of the sum over ``losses`` (each
    one step's indices on this rank, gathered from every rank, and a factor on the inputs)
    of the mean loss, relative to the largest gradient value."""
    ref.zero_grad()
    for idx, factor in losses:
        union = torch.tensor(_all_indices(idx.tolist()))
        F.cross_entropy(ref(factor * data.tensors[0][union].to(device)),
                        data.tensors[1][union].to(device)).backward()
    return _max_error(net, ref)


def _hdp_gradient(device: torch.device) -> dict[str, Any]:
    """Through the whole API (loader split, weight, hook, clock): grad == single process."""
    data = _blobs(200)
    net = _classifier().to(device)
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    loader = HeteroDataLoader(data, batch_size=64, seed=3)
    world = dist.get_world_size()
    caps = [10] + [None] * (world - 1) if world > 1 else None  # 3 workers: 10, 27, 27
    sink = Recorder()
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               max_local_batch=caps, metrics=sink)
    worst = 0.0
    for step, (x, y, idx) in enumerate(loader):
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        worst = max(worst, _gradient_error(net, ref, data, idx, device))
        opt.step()
        if step == 3:  # 64+64+64+8: the last, partial batch is split too
            break
    model.remove_hooks()
    return {"rel_err": worst, "split": list(model.plan.local_batches),
            "timings": _timings(sink.rows), "clock": type(model.clock).__name__}


def check_hdp_gradient() -> dict[str, Any]:
    return _hdp_gradient(torch.device("cpu"))


def check_cuda_hdp_gradient() -> dict[str, Any]:
    return _hdp_gradient(_cuda())


def check_pinned_split() -> dict[str, Any]:
    """A split pinned before training holds for two epochs with the mean gradient of one
    process; released, the planner plans again at once, and its plans are what runs."""
    data = _blobs(240)
    net = _classifier()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    loader = HeteroDataLoader(data, batch_size=60, seed=4)
    model = HeteroDataParallel(net, opt, loader, split="optimal", slowdown=None,
                               replan_every=2)
    pinned = [5, 20, 35][:dist.get_world_size()]
    pinned[-1] += 60 - sum(pinned)
    model.pin_split(pinned)
    splits, worst, exchanged, measured = [], 0.0, [], []
    for epoch in range(4):
        if epoch == 2:
            fitted = [f.num_samples for f in model.planner.fitters]
            model.pin_split(None)
        for x, y, idx in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            exchanged.append(model.comm.rows is not None)
            worst = max(worst, _gradient_error(net, ref, data, idx, torch.device("cpu")))
            opt.step()
            splits.append(list(model.last_metrics["local_batches"]))
            measured.append(model.last_metrics["measured"])
    model.remove_hooks()
    return {"pinned": pinned, "splits": splits, "rel_err": worst, "exchanged": exchanged,
            "measured": measured, "fitted": fitted,
            "history": [[r.step, r.reason, list(r.local_batches)] for r in model.plan_history]}


@dataclasses.dataclass
class Scores:
    """A forward's output that is a dataclass, not a tuple, list or dict."""

    logits: torch.Tensor


class ScoresNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _classifier()

    def forward(self, x: torch.Tensor) -> Scores:
        return Scores(self.net(x))


def check_hook_free() -> dict[str, Any]:
    """At an even split the steps that measure and exchange nothing run through the
    hook-free twin: one process's gradient with ``model.backward(loss)`` and with a plain
    ``loss.backward()`` (taken in turns), the same training as without the twin; and a
    loss made by ``model.module(x)`` on such a step is refused before the update."""
    data = _blobs(240)
    world = dist.get_world_size()
    trained, kinds, worst = [], [], 0.0
    for hook_free in (True, False):
        net = _classifier()
        ref = copy.deepcopy(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        loader = HeteroDataLoader(data, batch_size=20 * world, seed=4)
        model = HeteroDataParallel(net, opt, loader, split="optimal", slowdown=None,
                                   hook_free=hook_free)
        model.pin_split([20] * world)
        for _ in range(2):
            for step, (x, y, idx) in enumerate(loader):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                if step % 2:
                    loss.backward()
                else:
                    model.backward(loss)
                if hook_free:
                    kinds.append(model._cycle.hook_free)
                    ref.load_state_dict(net.state_dict())  # one process at this step
                    worst = max(worst, _gradient_error(net, ref, data, idx, CPU))
                opt.step()
        trained.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        if hook_free:
            refused, unchanged = _bypass_on_a_hook_free_step(model, opt, lambda out: out)
        model.remove_hooks()
    apart = float((trained[0] - trained[1]).abs().max() / trained[1].abs().max())
    scores = ScoresNet()  # its hook-free steps watch the tensor in the dataclass output
    ref = copy.deepcopy(scores.net)
    opt = torch.optim.SGD(scores.parameters(), lr=0.1)
    loader = HeteroDataLoader(data, batch_size=20 * world, seed=4)
    model = HeteroDataParallel(scores, opt, loader, split="optimal", slowdown=None)
    model.pin_split([20] * world)
    scores_free, scores_err = 0, 0.0
    for x, y, idx in loader:
        opt.zero_grad()
        model.backward(F.cross_entropy(model(x).logits, y))
        scores_free += model._cycle.hook_free
        ref.load_state_dict(scores.net.state_dict())
        scores_err = max(scores_err, _gradient_error(scores.net, ref, data, idx, CPU))
        opt.step()
    scores_refused, _ = _bypass_on_a_hook_free_step(model, opt, lambda out: out.logits)
    model.remove_hooks()
    return {"kinds": kinds, "rel_err": worst, "apart": apart, "refused": refused,
            "unchanged": unchanged, "scores_free": scores_free, "scores_err": scores_err,
            "scores_refused": scores_refused, "twin": model.attached.twin is not None}


def _bypass_on_a_hook_free_step(model: HeteroDataParallel, opt: torch.optim.Optimizer,
                                logits: Callable[[Any], torch.Tensor]) -> tuple[str, bool]:
    """Train to the loader's next hook-free step, and make its loss with
    ``model.module(x)`` (no DDP forward): the optimizer step's error (or "stepped"), and
    whether the parameters are unchanged."""
    batches = iter(model.loader)
    x, y, _ = next(batches)
    while not model._cycle.hook_free:
        opt.zero_grad()
        model.backward(F.cross_entropy(logits(model(x)), y))
        opt.step()
        x, y, _ = next(batches)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    F.cross_entropy(logits(model.module(x)), y).backward()
    try:
        opt.step()
        refused = "stepped"
    except RuntimeError as error:
        refused = str(error)
    return refused, all(torch.equal(a, p) for a, p in zip(before, model.parameters(),
                                                          strict=True))


def check_compiled() -> dict[str, Any]:
    """``torch.compile`` either way PyTorch documents it with DDP: the module compiled, then
    wrapped, or the wrapper compiled (dynamo traces the runtime's forward). A pinned
    uneven split trains as one process does, and the steps are measured (the clock's marks
    are real, not constants of a traced graph). ``aot_eager``: dynamo and autograd's
    tracing without a C compiler (inductor gave the same gradients, 2.2e-7). The wrapper
    compiled again at the even split, whose unmeasured steps run through the hook-free
    twin: the forward then calls the other DDP."""
    data = _blobs(240)
    out: dict[str, Any] = {}
    for compiled in ("module", "wrapper", "wrapper_even"):
        torch._dynamo.reset()
        net = _classifier()
        ref = copy.deepcopy(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        loader = HeteroDataLoader(data, batch_size=60, seed=4)
        sink = Recorder()
        inner = torch.compile(net, backend="aot_eager") if compiled == "module" else net
        model = HeteroDataParallel(inner, opt, loader, split="optimal", slowdown=None,
                                   metrics=sink)
        world = dist.get_world_size()
        pinned = [5, 20, 35][:world]
        pinned[-1] += 60 - sum(pinned)
        model.pin_split([60 // world] * world if compiled == "wrapper_even" else pinned)
        run = model if compiled == "module" else torch.compile(model, backend="aot_eager")
        worst, hook_free = 0.0, 0
        for _ in range(3):
            for x, y, idx in loader:
                opt.zero_grad()
                F.cross_entropy(run(x), y).backward()
                hook_free += model._cycle.hook_free
                worst = max(worst, _gradient_error(net, ref, data, idx, CPU))
                opt.step()
                ref_opt.step()
        model.remove_hooks()
        drift = max(float((p - q).abs().max())
                    for p, q in zip(net.parameters(), ref.parameters(), strict=True))
        out[compiled] = {"rel_err": worst, "drift": drift, "hook_free": hook_free,
                         "timings": _timings(sink.rows),
                         "fitted": [f.num_samples for f in model.planner.fitters]}
    return out


def _train_hetero(device: torch.device) -> dict[str, Any]:
    """Emulated speeds 1, 2, 4 (slowdowns 4, 2, 1): even phase, then the adapted phase."""
    os.environ["CANNIKIN_SLOWDOWN"] = "4,2,1"
    data = _blobs(6000)
    out: dict[str, Any] = {}
    for phase, steps in (("even", 16), ("optimal", 80)):
        net = _classifier().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        loader = HeteroDataLoader(data, batch_size=96, seed=1)
        sink = Recorder()
        model = HeteroDataParallel(net, opt, loader, split=phase, replan_every=5,
                                   metrics=sink, slowdown_profile=(0.004, 0.0004))
        losses, seen = [], []
        for step, (x, y, idx) in enumerate(loader):
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            losses.append(float(loss))
            seen += idx.tolist()
            if step + 1 == steps:
                break
        everyone = _all_indices(seen)
        tracker = model.prediction_tracker
        times = [r["step_time_s"] for r in sink.rows]
        out[phase] = {
            "step_times": times, "losses": losses,
            "local_batches": list(model.plan.local_batches),
            "window_error": tracker.median_window_error(),
            "step_error": tracker.median_step_error(),
            "windows": tracker.window_errors(),
            "chosen_windows": model.planner.chosen_tracker.window_errors(),
            "distinct_samples": len(set(everyone)), "samples": len(everyone),
            "rows": sink.rows[-3:], "timings": _timings(sink.rows),
        }
        model.remove_hooks()
    del os.environ["CANNIKIN_SLOWDOWN"]
    return out


def check_train_hetero() -> dict[str, Any]:
    return _train_hetero(torch.device("cpu"))


def check_cuda_train_hetero() -> dict[str, Any]:
    return _train_hetero(_cuda())


def check_eval_between_steps() -> dict[str, Any]:
    """An evaluation (forward outside a step, then a 0.3 s pause) after step 5, and one
    without the pause after step 7: the step after each is neither measured, so the pause
    never reaches the planner as forward time, nor timed by the prediction trackers."""
    data = _blobs(600)
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=48, seed=4)
    sink = Recorder()
    model = HeteroDataParallel(net, opt, loader, split="even", metrics=sink)
    timed = []  # the prediction tracker's steps after each step
    for step, (x, y, _) in enumerate(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        timed.append(len(model.prediction_tracker.step_errors()))
        if step in (5, 7):
            with torch.no_grad():
                model(x)
            time.sleep(0.3 if step == 5 else 0.0)
        if step == 9:
            break
    fitted = [n.fwd for n in model.cluster_model.nodes] if model.cluster_model else []
    return {"measured": [r["measured"] for r in sink.rows],
            "predicted": [r["predicted_step_time_s"] is not None for r in sink.rows],
            "timed": [now - before for before, now in zip([0, *timed], timed, strict=False)],
            "fwd_s": [r["fwd_s"] for r in sink.rows],
            "step_time_s": [r["step_time_s"] for r in sink.rows], "fitted_fwd": fitted}


def check_replan_not_measured() -> dict[str, Any]:
    """The warm-up's re-plan (after its last step) made 0.3 s of busy CPU on every rank: the
    next step's period counts it, its measurements (timings and CPU) do not, and its
    report carries it as the re-plan's time (the planner's stall)."""
    data = _blobs(600)
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=48, seed=4)
    sink = Recorder()
    model = HeteroDataParallel(net, opt, loader, metrics=sink)
    planner = model.planner
    replan = planner.replan

    def slow_replan(step: int, reason: str = "cadence", **kwargs: Any) -> Any:
        record = replan(step, reason, **kwargs)
        busy = time.process_time() + 0.3
        while time.process_time() < busy:
            pass
        return record

    planner.replan = slow_replan  # type: ignore[method-assign]
    _train_through(model, opt, loader, 6)
    return {"plans": [r.step for r in planner.history], "warmup": planner.config.warmup_steps,
            "stall_s": planner.plan_stall_s,
            **{key: [r[key] for r in sink.rows] for key in ("step_time_s", "cpu_s", "fwd_s")}}


def check_cpu_limit_changed() -> dict[str, Any]:
    """Each rank's CPU limit changes after the model is built (to 0.25, 0.5, 0.75 cores by
    rank, as ``docker update --cpus`` would): every re-plan reads it again, and its
    reports carry it to every rank's planner."""
    data = _blobs(600)
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=48, seed=4)
    model = HeteroDataParallel(net, opt, loader)
    read = parallel.own_cpu_limit
    parallel.own_cpu_limit = functools.partial(float, 0.25 * (dist.get_rank() + 1))
    try:
        _train_through(model, opt, loader, 10)
    finally:
        parallel.own_cpu_limit = read
    return {"planner": model.planner.cpu_cores,
            "plans": [r.step for r in model.planner.history]}


def check_one_rank_decides() -> dict[str, Any]:
    """The last rank reports the most CPU cores: once the exchange has told every rank so,
    it alone chooses each re-plan (the others fit, receive its choice and adopt it), on
    emulated speeds 4, 2, 1; every rank's plans come out the same. Each rank's list of
    the re-plans it chose: (step, the decider as it saw it)."""
    os.environ["CANNIKIN_SLOWDOWN"] = "4,2,1"
    data = _blobs(4000)
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=96, seed=2)
    model = HeteroDataParallel(net, opt, loader, replan_every=3, warmup_steps=3,
                               slowdown_profile=(0.002, 0.0002))
    rank, world = dist.get_rank(), dist.get_world_size()
    model.cpu_cores = 2.0 if rank == world - 1 else 1.0
    read = parallel.own_cpu_limit  # as every re-plan reads them again
    parallel.own_cpu_limit = functools.partial(float, model.cpu_cores)
    planner = model.planner
    planner.config.plan_budget = None  # the cadence alone: re-plans at 2, 5 and on
    decide = planner._decide
    decided = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        decided.append([args[0], planner.decider])
        return decide(*args, **kwargs)

    planner._decide = counted  # type: ignore[method-assign]
    try:
        _train_through(model, opt, loader, 60)
    finally:
        parallel.own_cpu_limit = read
    model.remove_hooks()
    del os.environ["CANNIKIN_SLOWDOWN"]
    mine = [[r.step, r.reason, list(r.local_batches), r.predicted_step_s,
             [[w.rank, w.step_time] for w in r.costly]] for r in planner.history]
    histories: list[Any] = [None] * world
    dist.all_gather_object(histories, mine)
    chosen: list[Any] = [None] * world
    dist.all_gather_object(chosen, decided)
    return {"decided": chosen, "histories": histories,
            "replans": [r.step for r in planner.history[1:]]}


def check_decider_fails() -> dict[str, Any]:
    """The rank that decides raises in its second re-plan's choice: it sends ``failed``
    before raising, so the others raise too instead of waiting for its broadcast."""
    data = _blobs(600)
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=48, seed=4)
    model = HeteroDataParallel(net, opt, loader, replan_every=2, warmup_steps=2)
    model.cpu_cores = 1.0  # every rank alike: rank 0 decides
    planner = model.planner
    planner.config.plan_budget = None  # the cadence alone: re-plans after steps 1 and 3
    decide = planner._decide
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("no split fits")
        return decide(*args, **kwargs)

    planner._decide = failing  # type: ignore[method-assign]
    raised, steps = "", 0
    try:
        for x, y, _ in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
    except (ValueError, RuntimeError) as error:
        raised = f"{type(error).__name__}: {error}"
    model.remove_hooks()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, raised)
    return {"raised": raised, "others": gathered[1:], "steps": steps,
            "decider": planner.decider}


def _noise_updates(model: HeteroDataParallel, opt: torch.optim.Optimizer,
                   loader: HeteroDataLoader, steps: int) -> list[int]:
    """The noise scale's count of updates after each of ``steps`` training steps."""
    updates = []
    for step, (x, y, _) in enumerate(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        updates.append(model.planner.noise.num_updates)
        if step + 1 == steps:
            break
    model.remove_hooks()
    return updates


def check_adam_noise_reset() -> dict[str, Any]:
    """Adam preconditions after 5 steps: the noise scale's count of updates after each step
    (it sees each step's norms one step late) starts over when the space changes. AdamScale
    reads the noise scale, so every step's norms are taken."""
    data = _blobs(600)
    net = _classifier()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loader = HeteroDataLoader(data, batch_size=48, seed=5)
    model = HeteroDataParallel(net, opt, loader, split="even", lr_scaling="adamscale")
    updates = _noise_updates(model, opt, loader, steps=10)
    return {"updates": updates, "noise_scale": model.noise_scale}


def check_noise_stride() -> dict[str, Any]:
    """A fixed total batch with SGD and the default LR rule: the noise scale decides
    nothing, so the gradient norms are taken on every NORM_STRIDE-th step only."""
    data = _blobs(600)
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=30, seed=5)
    model = HeteroDataParallel(net, opt, loader, split="even")
    return {"updates": _noise_updates(model, opt, loader, steps=18), "stride": NORM_STRIDE}


def _seeded_run(optimizer: str, seeded: bool, steps: int = 40) -> dict[str, Any]:
    """Train on a split with a rank at 0 samples, the loss through ``model.backward(loss)``
    (``seeded``) or ``loss.backward()``; each step's gradient against one process's."""
    data = _blobs(60 * steps)  # one epoch
    net = _classifier()
    opt = (torch.optim.Adam(net.parameters(), lr=1e-2) if optimizer == "adam"
           else torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    loader = HeteroDataLoader(data, batch_size=60, seed=6)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               lr_scaling="adamscale" if optimizer == "adam" else "adascale")
    split = [22, 0, 38][:dist.get_world_size()]  # the figures are rank 0's: it has samples
    split[-1] += 60 - sum(split)
    model.pin_split(split)
    worst, refused = 0.0, ""
    reference_sq: list[float] = []  # each step's |g|^2, one process
    received: list[tuple[int, float]] = []  # (step, |g|^2) as the noise scale got them
    update = model.planner.noise.update

    def spy(sqnorms: list[float], batches: list[int], global_sqnorm: float) -> None:
        received.append((model.step - 1, global_sqnorm))  # the exchange is a step late
        update(sqnorms, batches, global_sqnorm)

    model.planner.noise.update = spy  # type: ignore[method-assign]
    for step, (x, y, idx) in enumerate(loader):
        if step == steps:
            break
        opt.zero_grad()
        logits = model(x)
        if seeded and step == 0:
            try:
                model.backward(F.cross_entropy(logits, y, reduction="none"))
            except RuntimeError as error:
                refused = str(error)
        loss = F.cross_entropy(logits, y)
        if seeded:
            model.backward(loss)
        else:
            loss.backward()
        ref = copy.deepcopy(net)
        worst = max(worst, _gradient_error(net, ref, data, idx, torch.device("cpu")))
        reference_sq.append(sum(float(q.grad.square().sum()) for q in ref.parameters()))
        opt.step()
    model.remove_hooks()
    global_err = max((_relative(got, reference_sq[step]) for step, got in received),
                     default=math.inf)
    return {"rel_err": worst, "noise_scale": model.noise_scale, "refused": refused,
            "global_sqnorm_err": global_err, "global_sqnorms": len(received),
            "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()}


def check_seeded_backward() -> dict[str, Any]:
    """``model.backward(loss)`` (b_i / B in the backward's seed, the hook scales nothing)
    against ``loss.backward()`` (the hook scales): one process's gradient, and the same
    training and noise scale, with SGD and with Adam's preconditioned norms."""
    return {f"{opt}_{'seeded' if seeded else 'plain'}": _seeded_run(opt, seeded)
            for opt in ("sgd", "adam") for seeded in (False, True)}


def check_idle_route() -> dict[str, Any]:
    """Splits that give some workers 0 samples: the busy ones all-reduce, the one with the
    largest batch broadcasts the sum to the idle ones (cannikin.runtime.routes). With DDP's
    default buckets and with ``gradient_as_bucket_view=True`` (the gradients are views of
    the buffer the idle rank receives into)."""
    return {"copied": _idle_route(bucket_view=False), "views": _idle_route(bucket_view=True)}


def _idle_route(bucket_view: bool) -> dict[str, Any]:
    """Every rank's gradient against one process's, over splits idling different workers,
    one idling none and one seen before (loss.backward() on an empty batch: NaN there,
    which must not reach the sum); each rank's part in each step; the groups made (each
    set of ranks once); every rank's parameters at the end."""
    world = dist.get_world_size()
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = _blobs(60 * 20)
    loader = HeteroDataLoader(data, batch_size=60, seed=4)
    # the noise scale decides nothing (norms every 8th step): every measured step times
    # its all-reduces all the same
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               gradient_as_bucket_view=bucket_view, lr_scaling="none")
    splits = [(40, 20, 0), (0, 25, 35), (20, 20, 20), (40, 20, 0)]  # 3 workers
    made: list[list[int]] = []
    new_group = dist.new_group

    def counted(ranks: list[int], **kwargs: Any) -> Any:
        made.append(list(ranks))
        return new_group(ranks, **kwargs)

    dist.new_group = counted
    worst, parts = 0.0, []
    batches = iter(loader)
    try:
        for split in splits:
            model.pin_split(split)
            for _ in range(4):
                x, y, idx = next(batches)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                worst = max(worst, _gradient_error(net, copy.deepcopy(net), data, idx, CPU))
                route = model.comm.route
                parts.append("all" if route is None else "idle" if route.busy is None
                             else "source" if route.fan is not None else "busy")
                opt.step()
    finally:
        dist.new_group = new_group
    model.remove_hooks()
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (worst, parts, params.tolist()))
    planner = model.planner
    return {"rel_err": max(w for w, _, _ in every), "parts": [p for _, p, _ in every],
            "made": made, "params_differ": max(float((torch.tensor(p) - params).abs().max())
                                               for _, _, p in every),
            "fitted_apart": planner.config.idle_route,
            "comm_samples": [planner.comm_fitter.num_samples,
                             planner.idle_comm_fitter.num_samples]}


class OomOnRank1(nn.Module):
    """Raises CUDA's out-of-memory error on rank 1 for local batches above 15. ``full``: a
    BatchNorm1d inside (buffers DDP broadcasts before every forward) and the loss computed
    in forward (a 0-dim output), as many models do."""

    def __init__(self, full: bool = False) -> None:
        super().__init__()
        self.net = _classifier()
        self.full = full
        if full:
            self.net.insert(1, nn.BatchNorm1d(64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1 and len(x) > 15:
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory")
        logits = self.net(x)
        return F.cross_entropy(logits, y) if self.full else logits


def check_oom_retry() -> dict[str, Any]:
    """A simulated OOM lowers that worker's cap, re-plans everywhere, retries the samples."""
    return _oom_retry(OomOnRank1())


class OomEverywhere(nn.Module):
    """Raises CUDA's out-of-memory error on every rank in its ``at``-th forward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.net = _classifier()
        self.at = at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.at:
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory")
        return self.net(x)


def check_oom_without_exchange() -> dict[str, Any]:
    """On a CPU-only job a held plan's unmeasured steps carry no exchange, so an
    out-of-memory there (only a simulated one can happen) could not reach the other ranks:
    it is raised, on every rank alike here, instead of recovered from (the steps that carry
    the exchange recover: ``check_oom_retry``)."""
    net = OomEverywhere(at=6)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(_blobs(600), batch_size=60, seed=2)
    model = HeteroDataParallel(net, opt, loader, split="optimal", slowdown=None)
    model.pin_split([20, 20, 20][:dist.get_world_size()])  # held: every 4th step measured
    exchanged, raised = [], ""
    for step, (x, y, _) in enumerate(loader):
        opt.zero_grad()
        try:
            F.cross_entropy(model(x), y).backward()
        except torch.cuda.OutOfMemoryError as error:
            raised = f"step {step}: {error}"
            break
        exchanged.append(model.comm.rows is not None)
        opt.step()
    model.remove_hooks()
    return {"exchanged": exchanged, "raised": raised}


def check_oom_retry_batchnorm() -> dict[str, Any]:
    """The same with BatchNorm and DDP's default buffer broadcast (the retried forward must
    not broadcast a second time: the peers would pair it with a gradient bucket) and the
    loss as the model's output."""
    return _oom_retry(OomOnRank1(full=True))


def _oom_retry(net: OomOnRank1) -> dict[str, Any]:
    data = _blobs(300)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=60, seed=2)
    sink = Recorder()
    model = HeteroDataParallel(net, opt, loader, split="optimal", metrics=sink)
    seen: list[int] = []
    updates = 0
    for x, y, idx in loader:
        opt.zero_grad()
        out = model(x, y)
        (out if net.full else F.cross_entropy(out, y)).backward()
        opt.step()
        if model.last_metrics.get("skipped") is None:
            updates += 1
            seen += idx.tolist()
    everyone = _all_indices(seen)
    return {"updates": updates, "distinct": len(set(everyone)), "samples": len(everyone),
            "cap": model.planner.config.caps[1], "split": list(model.plan.local_batches)}


class _FailInBackward(torch.autograd.Function):
    """The identity; its backward asks ``point`` first (which may raise)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, point: OomInBackward) -> torch.Tensor:
        ctx.point = point
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.point.reached(len(grad))
        return grad, None


class OomInBackward(nn.Module):
    """Where the backward raises CUDA's out-of-memory error on ``rank`` for more than 15
    samples, from inside autograd, once ``model`` has taken ``from_step`` steps (with
    ``forward_pass``: in the forward of that micro-batch instead). ``failures`` records each:
    the gradient buckets ``model`` had all-reduced by then, the pass and the step's passes."""

    def __init__(self, from_step: int, forward_pass: int | None = None, rank: int = 1) -> None:
        super().__init__()
        self.rank = rank
        self.from_step = from_step
        self.forward_pass = forward_pass
        self.model: HeteroDataParallel | None = None
        self.failures: list[tuple[int, int, int]] = []

    def watch(self, model: HeteroDataParallel) -> None:
        """Read ``model``'s steps, buckets and passes; not as a submodule (the model wraps
        this module: a cycle in the module tree)."""
        object.__setattr__(self, "model", model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_pass is None:
            out: torch.Tensor = _FailInBackward.apply(x, self)
            return out
        assert self.model is not None
        if self.model._cycle.pass_index == self.forward_pass:
            self.reached(len(x))
        return x

    def reached(self, batch: int) -> None:
        assert self.model is not None
        if dist.get_rank() == self.rank and batch > 15 and self.model.step >= self.from_step:
            cycle = self.model._cycle
            self.failures.append((len(self.model.comm.reductions), cycle.pass_index,
                                  len(cycle.passes)))
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory in backward")


def _oom_backward(where: int, batch_size: int, from_step: int, *, split: str = "optimal",
                  caps: list[int | None] | None = None, passes: int = 1,
                  overflow: bool = False, forward_pass: int | None = None,
                  device: torch.device = CPU, also: int | None = None,
                  batchnorm: bool = False, **ddp_kwargs: Any) -> dict[str, Any]:
    """Rank 1 runs out of memory in backward above 15 samples from step ``from_step`` on,
    ``where`` modules from the output of an MLP whose every layer is a gradient bucket of
    its own once DDP rebuilt its buckets after the first step (one before); the
    run goes on through ``model.backward``, and its parameters against one process's
    trained on the union of each step that was taken (SGD with momentum). ``overflow``:
    through AMP's GradScaler, with an infinite loss on the other ranks at the first failure:
    the scaler skips that step on every rank (its samples are not trained on), rank 1 too,
    whose own gradient is finite. ``also``: rank 2 fails as well, ``also`` modules from the
    output. ``batchnorm``: a BatchNorm1d after the first layer (its statistics are each
    worker's, so the parameters are not one process's)."""
    steps = 4
    data = _blobs(batch_size * (steps + overflow))
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                               nn.Linear(64, 4)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(64))
    ref = copy.deepcopy(nn.Sequential(*layers)).to(device)
    points = {1: (where, OomInBackward(from_step, forward_pass))}
    if also is not None:
        points[2] = (also, OomInBackward(from_step, rank=2))
    modules = list(layers)
    for at, point in sorted(points.values(), key=lambda p: p[0]):  # nearest the output first
        modules.insert(len(layers) - at, point)
    net = nn.Sequential(*modules).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    loader = HeteroDataLoader(data, batch_size=batch_size, seed=2)
    model = HeteroDataParallel(net, opt, loader, split=split, max_local_batch=caps,
                               max_micro_batches=passes, recover_backward_oom=True,
                               bucket_cap_mb=0.001, **ddp_kwargs)
    for _, point in points.values():
        point.watch(model)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10) if overflow else None
    seen: list[int] = []
    updates = skipped = 0
    for step in loader.steps():
        opt.zero_grad()
        mine: list[int] = []
        before = model.step
        infinite = (overflow and before == from_step and skipped == 0
                    and dist.get_rank() != 1)
        for x, y, idx in step:
            loss = (F.cross_entropy(model(x.to(device)), y.to(device))
                    * (math.inf if infinite else 1.0))
            model.backward(loss if scaler is None else scaler.scale(loss))
            mine += idx.tolist()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if model.step == before:
            skipped += 1
            continue
        updates += 1
        seen += mine
        union = _all_indices(mine)
        ref_opt.zero_grad()
        F.cross_entropy(ref(data.tensors[0][union].to(device)),
                        data.tensors[1][union].to(device)).backward()
        ref_opt.step()
    model.remove_hooks()
    everyone = _all_indices(seen)
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, [p.failures for _, p in points.values()])
    return {"updates": updates, "skipped": skipped, "steps": steps,
            "samples": len(everyone), "distinct": len(set(everyone)),
            "dataset": len(data) - overflow * batch_size,
            "cap": model.planner.config.caps[1], "split": list(model.plan.local_batches),
            "failures": failures[1][0], "failures_2": None if also is None else failures[2][-1],
            "cap_2": model.planner.config.caps[2], "buckets": len(model.comm.sizes),
            "param_err": max(float((p - q).detach().abs().max())
                             for p, q in zip(net.parameters(), ref.parameters(), strict=True))}


def check_oom_backward() -> dict[str, Any]:
    """An out-of-memory in backward before any gradient bucket was all-reduced, from the
    first step (with DDP's search for unused parameters, whose all-reduce follows the
    buckets'); after two of three; and in both micro-batches of a step (the first under
    DDP's no_sync); under AMP, where the first failure's step also overflows; in the
    forward of a step's second micro-batch (its first made the exchange already); and on
    two ranks at once, one after two buckets and one before any; with BatchNorm (DDP
    broadcasts its buffers before each step's forward). Ranks that ask for it differently
    are refused."""
    net = _classifier()
    try:
        HeteroDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1),
                           HeteroDataLoader(_blobs(30), batch_size=6),
                           recover_backward_oom=dist.get_rank() == 1)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {"refused": refused,
            "before": _oom_backward(0, 60, 0, find_unused_parameters=True),
            "after": _oom_backward(3, 60, 2),
            "passes": _oom_backward(3, 108, 2, split="even", caps=[20, 20, 20], passes=4),
            "amp": _oom_backward(3, 60, 2, overflow=True),
            "forward_pass": _oom_backward(3, 108, 2, split="even", caps=[20, 20, 20],
                                          passes=4, forward_pass=1),
            "two_ranks": _oom_backward(3, 60, 2, also=0),
            "batchnorm": _oom_backward(3, 60, 2, batchnorm=True)}


def check_cuda_oom_backward() -> dict[str, Any]:
    """The CUDA path of the recovery (the rows staged through pinned memory, the finisher's
    stream) on cuda:0 shared by the gloo workers: after two of three buckets, and under AMP."""
    return {"after": _oom_backward(3, 60, 2, device=_cuda()),
            "amp": _oom_backward(3, 60, 2, overflow=True, device=_cuda())}


def _amp_run(optimizer: str, scale: float | None, overflow_at: tuple[int, ...] = (),
             steps: int = 24) -> dict[str, Any]:
    """Train with a GradScaler starting at ``scale`` (None: no scaler); the loss is inf on
    the steps ``overflow_at``, which the scaler then skips (halving its scale)."""
    data = _blobs(2400)
    net = _classifier()
    opt = (torch.optim.Adam(net.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(net.parameters(), lr=0.05))
    loader = HeteroDataLoader(data, batch_size=48, seed=5)
    model = HeteroDataParallel(net, opt, loader, split="even")
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale,
                                                              growth_interval=10**9)
    skipped, unmeasured = [], []
    for step, (x, y, _) in enumerate(loader):
        if step == steps:
            break
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * (math.inf if step in overflow_at else 1.0)
        before = model.step
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if model.step == before:
            skipped.append(step)
        elif not model.last_metrics["measured"]:
            unmeasured.append(step)
    model.remove_hooks()
    return {"noise_scale": model.noise_scale, "skipped": skipped, "unmeasured": unmeasured,
            "finite": all(bool(torch.isfinite(p).all()) for p in net.parameters())}


def check_amp() -> dict[str, Any]:
    """AMP's loss scaling: the noise scale is the unscaled run's (the hook takes |g_i|^2 and
    |g|^2 of the scaled gradients, the same space); an overflowed step is skipped and the
    step after it, whose cycle spans both, is not measured."""
    runs = {f"{opt}_{'scaled' if scale else 'plain'}": _amp_run(opt, scale)
            for opt in ("sgd", "adam") for scale in (None, 2.0**10)}
    runs["overflow"] = _amp_run("adam", 2.0**10, overflow_at=(3, 12))
    return runs


class TinyLM(nn.Module):
    """A Hugging Face-style model: tied input and output embeddings, and the loss computed
    in forward from ``labels``, returned as ``out.loss`` beside ``out.logits``."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> ModelOutputLike:
        hidden = torch.tanh(self.mix(self.embed(input_ids)))
        logits = hidden @ self.embed.weight.t()  # tied to the input embedding
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return ModelOutputLike(loss=loss, logits=logits)


def check_model_output() -> dict[str, Any]:
    """A ModelOutput-returning model with tied weights, trained through the whole API with
    an uneven split and a final partial batch: every step's gradient against one process
    on the union of the step's samples."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 32, (100, 9), generator=gen)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(100))
    torch.manual_seed(0)
    net = TinyLM()
    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loader = HeteroDataLoader(data, batch_size=24, seed=1)
    world = dist.get_world_size()
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               max_local_batch=[3] + [None] * (world - 1))
    worst = 0.0
    steps = 0
    for ids, labels, idx in loader:
        opt.zero_grad()
        out = model(ids, labels=labels)
        out.loss.backward()
        union = torch.tensor(_all_indices(idx.tolist()))
        ref_opt.zero_grad()
        ref(data.tensors[0][union], labels=data.tensors[1][union]).loss.backward()
        scale = max(float(q.grad.abs().max()) for q in ref.parameters())
        worst = max(worst, max(float((p.grad - q.grad).abs().max())
                               for p, q in zip(net.parameters(), ref.parameters(),
                                               strict=True)) / scale)
        opt.step()
        ref_opt.step()
        steps += 1
    model.remove_hooks()
    drift = max(float((p - q).abs().max()) for p, q in zip(net.parameters(),
                                                           ref.parameters(), strict=True))
    return {"rel_err": worst, "steps": steps, "param_drift": drift,
            "output_type": type(out).__name__}


def check_ddp_habits() -> dict[str, Any]:
    """Habits of a DDP script: a step on the script's own tensors, a peek at the loader,
    ``set_epoch`` in the epoch loop, an evaluation over the training loader inside the
    training loop (of one step, and to the epoch's end), ``no_sync()``, parameters and
    modules picked by DDP's names, an average of the model (swa_utils' AveragedModel)."""
    data = _blobs(90)
    net = _classifier()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = HeteroDataLoader(data, batch_size=30, seed=5)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               max_local_batch=[4] + [None] * (dist.get_world_size() - 1))
    rank, world = dist.get_rank(), dist.get_world_size()
    peeked = len(next(iter(loader))[0])  # a peek: its samples must come again
    epochs: list[list[int]] = []
    evaluated: list[int] = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen: list[int] = []
        for step, (x, y, idx) in enumerate(loader):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            seen += idx.tolist()
            if step == 1 - epoch:  # after the second step, then after the first
                with torch.no_grad():
                    for inner, (seen_x, _, _) in enumerate(loader):
                        model(seen_x)
                        if inner == 0 and epoch == 0:
                            break
                    evaluated.append(inner + 1)
        epochs.append(_all_indices(seen))
    epoch_after = loader.epoch
    # a step on this rank's own tensors, outside the loader (after an uneven split): DDP's
    # mean of the ranks' gradients, one backward of the mean of their mean losses here
    def own(r: int) -> slice:
        return slice(r * 7, r * 7 + 7)
    x, y = data.tensors[0][own(rank)], data.tensors[1][own(rank)]
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    ref.load_state_dict(model.module.state_dict())
    sum(F.cross_entropy(ref(data.tensors[0][own(r)]), data.tensors[1][own(r)])
        for r in range(world)).div(world).backward()
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    worst = max(float((p.grad - q.grad).abs().max())
                for p, q in zip(net.parameters(), ref.parameters(), strict=True)) / scale
    ddp_keys = sorted(f"module.{key}" for key in model.module.state_dict())
    state_keys_as_ddp = sorted(model.state_dict()) == ddp_keys
    first_layer = [p for name, p in model.named_parameters() if name.startswith("module.0.")]
    names_as_ddp = ([name for name, _ in model.named_parameters()]
                    == [f"module.{name}" for name, _ in net.named_parameters()]
                    and first_layer == list(net[0].parameters())
                    and list(model.parameters()) == list(net.parameters()))
    modules_as_ddp = ([name for name, _ in model.named_modules()]
                      == [name for name, _ in DDP(copy.deepcopy(net)).named_modules()]
                      and all(model.get_submodule(name) is module
                              for name, module in model.named_modules()))
    try:
        AveragedModel(model)
        copied = "allowed"
    except TypeError as error:
        copied = str(error)
    average = AveragedModel(model.module)  # as the refusal says: the parameters in order
    average.update_parameters(model)
    averaged = all(torch.equal(a, p) for a, p in zip(average.module.parameters(),
                                                     net.parameters(), strict=True))
    model.load_state_dict(model.state_dict())
    try:
        model.no_sync()
        no_sync = "allowed"
    except RuntimeError as error:
        no_sync = str(error)
    model.remove_hooks()
    return {"peeked": peeked, "epochs": epochs, "epoch_after": epoch_after, "evaluated": evaluated,
            "outside_rel_err": worst, "no_sync": no_sync,
            "state_keys_as_ddp": state_keys_as_ddp, "names_as_ddp": names_as_ddp,
            "modules_as_ddp": modules_as_ddp, "copied": copied, "averaged": averaged}


class _ByIndex(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A TensorDataset seen through __getitem__ only (loaded by worker processes)."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.data[i]


def check_attach_later() -> dict[str, Any]:
    """The DDP order: wrap, build the optimizer from the wrapped model's parameters, build
    the loader (here loading in 2 processes), attach. Before attach a backward is plain
    DDP's mean; after, every step's gradient is one process's on the step's samples."""
    data = _blobs(120)
    net = _classifier()
    ref = copy.deepcopy(net)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = HeteroDataParallel(net, split="even", slowdown=None,
                               max_local_batch=[5] + [None] * (world - 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    own = slice(rank * 6, rank * 6 + 6)
    F.cross_entropy(model(data.tensors[0][own]), data.tensors[1][own]).backward()
    sum(F.cross_entropy(ref(data.tensors[0][r * 6:r * 6 + 6]), data.tensors[1][r * 6:r * 6 + 6])
        for r in range(world)).div(world).backward()
    def worst_error() -> float:
        scale = max(float(q.grad.abs().max()) for q in ref.parameters())
        return max(float((p.grad - q.grad).abs().max())
                   for p, q in zip(net.parameters(), ref.parameters(), strict=True)) / scale
    before = worst_error()
    loader = HeteroDataLoader(_ByIndex(data), batch_size=40, seed=3, num_workers=2)
    model.attach(opt, loader)
    after, seen, splits = 0.0, [], []
    for x, y, idx in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        union = torch.tensor(_all_indices(idx.tolist()))
        ref.zero_grad()
        F.cross_entropy(ref(data.tensors[0][union]), data.tensors[1][union]).backward()
        after = max(after, worst_error())
        opt.step()
        seen += idx.tolist()
        splits.append(list(model.plan.local_batches))
    loader.close()
    model.remove_hooks()
    return {"before_rel_err": before, "after_rel_err": after, "splits": splits,
            "epoch": _all_indices(seen)}


def check_step_timeout() -> dict[str, Any]:
    """Training lowers the group's timeout from its start-up value to the same figure on
    every rank; a rank whose rule differs is refused on every rank."""
    world = dist.group.WORLD
    assert world is not None
    world.set_timeout(timedelta(seconds=60))  # an earlier check's model lowered it already
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(_blobs(600), batch_size=48, seed=4)
    model = HeteroDataParallel(net, opt, loader, split="even")
    startup = model.collective_timeout.startup_s
    _train_through(model, opt, loader, 11)
    model.remove_hooks()
    timeouts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(timeouts, (model.collective_timeout.current_s,
                                      group_timeout_s(world)))
    try:
        StepTimeout(rule=TimeoutRule(floor_s=5.0 if dist.get_rank() == 1 else 30.0))
        refused = None
    except ValueError as error:
        refused = str(error)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, refused)
    world.set_timeout(timedelta(seconds=60))
    return {"startup": startup, "timeouts": timeouts, "refused": everyone}


def _accumulated_run(split: str, batch_size: int, caps: list[int | None], passes: int,
                     steps: int, slowdowns: tuple[float, ...] | None = None,
                     loss_scale: float | None = None,
                     max_batch: int | None = None) -> dict[str, Any]:
    """Train through ``loader.steps()`` with up to ``passes`` beyond the caps; each step's
    gradient against one process on the step's samples, this rank's |g_i|^2 against its
    own (gradient norms every step: ``adascale`` reads them). ``loss_scale``: through a
    GradScaler starting there; ``max_batch``: the total batch chosen by goodput."""
    data = _blobs(batch_size * steps)
    net = _classifier()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    loader = HeteroDataLoader(data, batch_size=batch_size, seed=5)
    if max_batch is not None:
        loader.autoscale_batch_size(max_batch)
    scaler = None if loss_scale is None else torch.amp.GradScaler(
        "cpu", init_scale=loss_scale, growth_interval=10**9)
    sink = Recorder()
    model = HeteroDataParallel(net, opt, loader, split=split, lr_scaling="adascale",
                               max_local_batch=caps, max_micro_batches=passes, metrics=sink,
                               slowdown=None if slowdowns is None
                               else slowdowns[dist.get_rank()])
    try:
        next(iter(loader))
        flat = None
    except RuntimeError as error:
        flat = str(error)
    worst = sq_worst = pass_worst = 0.0
    grouped = 0
    passes: list[list[int]] = []
    seen: list[int] = []
    for step, micro in enumerate(loader.steps()):
        opt.zero_grad()
        mine: list[int] = []
        sizes = []
        for x, y, idx in micro:
            loss = F.cross_entropy(model(x), y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            mine += idx.tolist()
            sizes.append(len(idx))
        scale_now = 1.0 if scaler is None else float(scaler.get_scale())
        readout = model.comm.read_step(norms=True)
        local_sq, pass_sq = readout.local_sqnorm, readout.pass_sqnorms
        local_sq /= scale_now ** 2
        if pass_sq:  # each micro-batch's own |g|^2, the noise scale's groups
            start = 0
            for size, got in zip(sizes, pass_sq, strict=True):
                part = mine[start:start + size]
                start += size
                ref.zero_grad()
                F.cross_entropy(ref(data.tensors[0][part]), data.tensors[1][part]).backward()
                pass_worst = max(pass_worst, _relative(got / scale_now ** 2, _sqnorm(ref)))
                grouped += 1
        union = torch.tensor(_all_indices(mine))
        ref.zero_grad()
        F.cross_entropy(ref(data.tensors[0][union]), data.tensors[1][union]).backward()
        scale = max(float(q.grad.abs().max()) for q in ref.parameters())
        worst = max(worst, max(float((p.grad / scale_now - q.grad).abs().max())
                               for p, q in zip(net.parameters(), ref.parameters(),
                                               strict=True)) / scale)
        if model._cycle.norms and mine:
            ref.zero_grad()
            F.cross_entropy(ref(data.tensors[0][mine]), data.tensors[1][mine]).backward()
            sq_worst = max(sq_worst, _relative(local_sq, _sqnorm(ref)))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sizes)
        passes.append([len(p) for p in everyone])
        seen += mine
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if step + 1 == steps:
            break
    model.remove_hooks()
    timed = [sorted(int(b) for b in f.batch_sizes()) for f in model.planner.fitters]
    return {"rel_err": worst, "sqnorm_err": sq_worst, "passes": passes, "flat": flat,
            "split": list(model.plan.local_batches), "timings": _timings(sink.rows),
            "timed_sizes": timed, "samples": len(_all_indices(seen)),
            "distinct": len(set(_all_indices(seen))), "steps": model.step,
            "totals": [row["total_batch"] for row in sink.rows], "pass_sqnorm_err": pass_worst,
            "grouped": grouped,
            "noise_updates": model.planner.noise.num_updates,
            "splits": [row["local_batches"] for row in sink.rows]}


def check_accumulate() -> dict[str, Any]:
    """Even split 20/22/22 under caps 5, 7, none and 4 passes at most: 4, 4 and 1 passes,
    sizes 6,6,5,5 on the second rank (the gradient rescaled between passes); then the
    optimal split of a batch four times the caps' sum on emulated speeds 1/3, 1/3, 1."""
    return {"even": _accumulated_run("even", 64, [5, 7, None], passes=4, steps=6),
            "optimal": _accumulated_run("optimal", 96, [8, 8, 8], passes=8, steps=16,
                                        slowdowns=(3.0, 3.0, 1.0)),
            "amp_autoscale": _accumulated_run("optimal", 24, [6, 6, 6], passes=8, steps=16,
                                              loss_scale=2.0**10, max_batch=144)}


def check_backward_onto_gradients() -> dict[str, Any]:
    """Backwards onto gradients already there, as DDP scripts run them: two in a step (a
    GAN's discriminator on real, then on fake samples), through ``model.backward`` and
    ``loss.backward()`` in each order; gradients summed over two of the loader's steps before
    one update; ``zero_grad(set_to_none=False)``. Each gradient against one process's, and
    whether each step was measured; then a model that accumulates micro-batches, whose
    step begins with the last step's gradients left."""
    data = _blobs(30 * 12)
    net = _classifier()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(data, batch_size=30, seed=3)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               lr_scaling="none")
    split = [0] * dist.get_world_size()
    split[0], split[1] = 12, 18  # a third rank idle: its gradient comes by the idle route
    model.pin_split(split)
    model.planner.config.measure_stride = 1  # pinned: every step measured that can be
    steps = iter(loader)

    def backward(loss: torch.Tensor, seeded: bool) -> None:
        model.backward(loss) if seeded else loss.backward()

    errors: dict[str, float] = {}
    measured: list[bool] = []
    for first, second in [(True, True), (False, True), (True, False), (False, False)]:
        x, y, idx = next(steps)
        ref.load_state_dict(model.module.state_dict())
        opt.zero_grad()
        backward(F.cross_entropy(model(x), y), first)
        backward(F.cross_entropy(model(0.5 * x), y), second)
        errors[f"twice_{'seeded' if first else 'plain'}_{'seeded' if second else 'plain'}"] = (
            _union_error(net, ref, data, [(idx, 1.0), (idx, 0.5)]))
        opt.step()
        measured.append(bool(model.last_metrics["measured"]))
    ref.load_state_dict(model.module.state_dict())
    opt.zero_grad()
    summed = []
    for _ in range(2):  # no zero_grad between the two steps
        x, y, idx = next(steps)
        model.backward(F.cross_entropy(model(x), y))
        summed.append((idx, 1.0))
    errors["over_two_steps"] = _union_error(net, ref, data, summed)
    opt.step()
    x, y, idx = next(steps)
    ref.load_state_dict(model.module.state_dict())
    opt.zero_grad(set_to_none=False)
    model.backward(F.cross_entropy(model(x), y))
    errors["zeros_left"] = _union_error(net, ref, data, [(idx, 1.0)])
    opt.step()
    for _ in range(4):  # one backward a step: measured again at the stride
        x, y, idx = next(steps)
        opt.zero_grad()
        model.backward(F.cross_entropy(model(x), y))
        opt.step()
        measured.append(bool(model.last_metrics["measured"]))
    model.remove_hooks()
    return {"errors": errors, "measured": measured,
            "micro_batches_refused": _stale_micro_batches()}


def check_summed_loss() -> dict[str, Any]:
    """A loss summed over the local batch (pytorch/examples' VAE) and the mean, on a pinned
    uneven split, the noise scale deciding (norms on every measured step): what the loss
    check concluded, and the warnings rank 0 logged. Also a mean loss trained to near 0
    (through a plain ``loss.backward()``), where the squared norms of the workers' mean
    gradients grow with their batches."""
    return {"sum": _loss_check_run("sum"), "mean": _loss_check_run("mean"),
            "mean_converged": _loss_check_run("mean", steps=40, lr=0.5, seeded=False)}


class _KeptWarnings(logging.Handler):
    """The warnings a logger gives while attached (:meth:`keep`)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())

    @contextmanager
    def keep(self, name: str) -> Iterator[list[str]]:
        logging.getLogger(name).addHandler(self)
        try:
            yield self.messages
        finally:
            logging.getLogger(name).removeHandler(self)


def _loss_check_run(reduction: str, steps: int = 16, lr: float = 1e-3,
                    seeded: bool = True) -> dict[str, Any]:
    with _KeptWarnings().keep("cannikin.runtime.planner") as warnings:
        model, loss = _train_loss_check(reduction, steps, lr, seeded)
    check = model.planner.loss_check
    return {"summed": check.summed, "slope": check.slope, "steps": check.steps,
            "last_loss": loss, "warnings": [w for w in warnings if "looks summed" in w]}


def _train_loss_check(reduction: str, steps: int, lr: float,
                      seeded: bool) -> tuple[HeteroDataParallel, float]:
    """The model after ``steps`` steps of SGD at ``lr`` (momentum 0.9) and its last loss,
    the loss through ``model.backward(loss)`` (``seeded``) or ``loss.backward()``."""
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    loader = HeteroDataLoader(_blobs(60 * steps), batch_size=60, seed=2)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               lr_scaling="adascale")
    model.pin_split([6, 20, 34][:dist.get_world_size() - 1] + [34])
    model.planner.config.measure_stride = 1
    for x, y, _ in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        if seeded:
            model.backward(loss)
        else:
            loss.backward()
        opt.step()
    model.remove_hooks()
    return model, float(loss.detach())


def check_gan() -> dict[str, Any]:
    """pytorch/examples' DCGAN loop, the discriminator D trained through the loader, the
    generator G in plain DDP on noise of the step's local batch. As DDP scripts run it (two
    backwards a step, G's step through D's forward) no step can be measured: the warning
    each rank gives. As the warning says (one backward of the summed loss, G's step
    through D's plain module, G's loss weighed by ``world_size * step_share``): each
    step measured, and both gradients against one process's, on a pinned uneven split."""
    with _KeptWarnings().keep("cannikin.runtime.unmeasured") as warnings:
        naive = _gan(recipe=False, steps=12)
    recipe = _gan(recipe=True, steps=4)
    return {"naive": naive, "naive_warnings": [w for w in warnings if "none of the last" in w],
            "recipe": recipe, "module_step_refused": _module_step_refused(),
            "unused_step_refused": _module_step_refused(unused=True)}


def _module_step_refused(unused: bool = False) -> str:
    """A step's loss made by the plain module (what the GAN recipe does for the generator's
    step), then the optimizer step: the error every rank raises (empty: none). With
    ``unused``, the loss made by the wrapper, of a model with a layer its forward skips,
    without ``find_unused_parameters``: DDP never launches the last bucket."""
    torch.manual_seed(0)
    net = Unused() if unused else _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(60, IN), torch.randint(0, OUT, (60,)))
    loader = HeteroDataLoader(data if unused else _blobs(60), batch_size=30, seed=3)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None)
    refused = ""
    for x, y, *_ in loader:
        opt.zero_grad()
        model.backward(F.cross_entropy((model if unused else model.module)(x), y))
        try:
            opt.step()
        except RuntimeError as error:
            refused = str(error)
        break
    model.remove_hooks()
    return refused


def check_unplannable_loops() -> dict[str, Any]:
    """Loops whose steps the runtime cannot measure, each said once per rank: a script that
    steps another optimizer than the one given to attach() (built again after it, say), and
    an optimizer that runs its forwards and backwards inside ``step(closure)`` (LBFGS); and
    an evaluation over the training loader, which is not one."""
    return {"other_optimizer": _unplannable(closure=False),
            "closure": _unplannable(closure=True), "evaluation": _evaluation_warnings()}


def _evaluation_warnings() -> list[str]:
    """An evaluation that iterates the training loader (no backward, no optimizer step)
    for as many steps as the others: nothing to say."""
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(_blobs(30 * 14), batch_size=30, seed=3)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None)
    with _KeptWarnings().keep("cannikin.runtime.unmeasured") as warnings, torch.no_grad():
        for x, _, _ in loader:
            model(x)
    model.remove_hooks()
    return [w for w in warnings if "none of the last" in w]


def _unplannable(closure: bool) -> dict[str, Any]:
    """14 steps of another optimizer than the attached one, or of LBFGS's closure: the
    warnings given and whether each step was measured."""
    net = _classifier()
    attached: torch.optim.Optimizer = (torch.optim.LBFGS(net.parameters(), lr=0.1, max_iter=3)
                                       if closure else torch.optim.SGD(net.parameters(), lr=0.05))
    stepped = attached if closure else torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(_blobs(30 * 14), batch_size=30, seed=3)
    model = HeteroDataParallel(net, attached, loader, split="even", slowdown=None)
    measured = []
    with _KeptWarnings().keep("cannikin.runtime.unmeasured") as warnings:
        for x, y, _ in loader:
            loss = functools.partial(_closure_loss, model, stepped, x, y)
            if closure:
                stepped.step(loss)
            else:
                loss()
                stepped.step()
            measured.append(model.last_metrics.get("measured"))
    model.remove_hooks()
    return {"warnings": [w for w in warnings if "none of the last" in w],
            "measured": measured}


def _closure_loss(model: HeteroDataParallel, optimizer: torch.optim.Optimizer,
                  x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An optimizer's closure: zero the gradients, then the loss and its backward."""
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def _gan(recipe: bool, steps: int) -> dict[str, Any]:
    """``steps`` of the DCGAN loop as DDP scripts write it, or as the warning says (on a
    pinned uneven split): whether each was measured, and both models' largest gradient
    error against one process's."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    net_d = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    net_g = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 16))
    ref_d, ref_g = copy.deepcopy(net_d), copy.deepcopy(net_g)
    opt_d = torch.optim.SGD(net_d.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(net_g.parameters(), lr=0.05)
    data = _blobs(60 * steps)
    noise = torch.randn(len(data), 4, generator=torch.Generator().manual_seed(1))
    loader = HeteroDataLoader(data, batch_size=60, seed=3)
    disc = HeteroDataParallel(net_d, opt_d, loader, split="even", slowdown=None,
                              lr_scaling="none")
    gen = DDP(net_g)
    if recipe:
        disc.pin_split([6, 20, 34][:world - 1] + [34])
        disc.planner.config.measure_stride = 1
    bce = F.binary_cross_entropy_with_logits
    measured, errors_d, errors_g = [], [], []
    for real, _, idx in loader:
        disc.zero_grad()
        fake = gen(noise[idx])
        ref_d.load_state_dict(net_d.state_dict())
        if recipe:
            out_real, out_fake = disc(real), disc(fake.detach())
            disc.backward(bce(out_real, torch.ones_like(out_real))
                          + bce(out_fake, torch.zeros_like(out_fake)))
        else:
            out = disc(real)
            disc.backward(bce(out, torch.ones_like(out)))
            out = disc(fake.detach())
            bce(out, torch.zeros_like(out)).backward()
        union = torch.tensor(_all_indices(idx.tolist()))
        ref_d.zero_grad()
        ref_real, ref_fake = ref_d(data.tensors[0][union]), ref_d(net_g(noise[union]).detach())
        (bce(ref_real, torch.ones_like(ref_real))
         + bce(ref_fake, torch.zeros_like(ref_fake))).backward()
        errors_d.append(_max_error(net_d, ref_d))
        share = disc.step_share
        opt_d.step()
        measured.append(bool(disc.last_metrics["measured"]))
        gen.zero_grad()
        out = disc.module(fake) if recipe else disc(fake)
        loss_g = bce(out, torch.ones_like(out))
        (loss_g * (world * share) if recipe and share is not None else loss_g).backward()
        ref_g.load_state_dict(net_g.state_dict())
        ref_g.zero_grad()
        ref_out = net_d(ref_g(noise[union]))
        bce(ref_out, torch.ones_like(ref_out)).backward()
        errors_g.append(_max_error(net_g, ref_g))
        opt_g.step()
    disc.remove_hooks()
    return {"measured": measured, "error_d": max(errors_d), "error_g": max(errors_g),
            "split": list(disc.plan.local_batches)}


def _max_error(net: nn.Module, ref: nn.Module) -> float:
    """Largest difference between the two models' gradients, relative to ``ref``'s largest."""
    scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    return max(float((p.grad - q.grad).abs().max())
               for p, q in zip(net.parameters(), ref.parameters(), strict=True)) / scale


def _stale_micro_batches() -> str:
    """A model of micro-batches (caps 4) whose second step begins without zero_grad: the
    error every rank raises (empty: none)."""
    net = _classifier()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(_blobs(120), batch_size=24, seed=3)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None,
                               max_local_batch=4, max_micro_batches=4)
    refused = ""
    try:
        for number, step in enumerate(loader.steps()):
            if number == 0:
                opt.zero_grad()
            for x, y, _ in step:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            if number == 1:
                break
    except RuntimeError as error:
        refused = str(error)
    model.remove_hooks()
    return refused


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    name.removeprefix("check_"): fn for name, fn in globals().items()
    if name.startswith("check_") and callable(fn)
}


def main() -> None:
    out_path, names = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    # gloo unless told otherwise, even where CUDA exists: the cuda checks then share cuda:0
    backend = os.environ.get("CANNIKIN_CHECK_BACKEND", "gloo")
    ctx = init_distributed(backend, timeout_s=60.0)  # a dead or hung peer fails in 60 s
    setup_logging(ctx.rank)
    results = {}
    for name in names:
        results[name] = CHECKS[name]()
        dist.barrier()
    if dist.get_rank() == 0:
        out_path.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
