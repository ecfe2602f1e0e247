"""torchrun worker for tests/test_accelerate.py: an Accelerate loop with
CannikinAccelerator, its gradient checked against one process.

Usage: ``torchrun --standalone --nproc-per-node=2 accelerate_worker.py OUT_JSON FOLDER``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.integrations.accelerate import STATE_FILE, CannikinAccelerator
from cannikin.runtime import HeteroDataLoader, HeteroDataParallel


def blobs(n: int = 320) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 16, generator=gen) * 2.0
    y = torch.randint(0, 4, (n,), generator=gen)
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=gen), y, torch.arange(n))


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def follow_speeds(accelerator: CannikinAccelerator) -> dict[str, Any]:
    """Three epochs on workers emulated 3x slower (rank 0) and 1x: the samples of each
    epoch, gathered, and the splits Cannikin chose."""
    os.environ["CANNIKIN_SLOWDOWN"] = "3,1"
    try:
        net = classifier()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        loader = HeteroDataLoader(blobs(), batch_size=48, seed=5)
        model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    finally:
        del os.environ["CANNIKIN_SLOWDOWN"]
    epochs: list[list[int]] = []
    splits = []
    for _ in range(3):
        seen: list[int] = []
        for x, y, idx in loader:
            optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            seen += accelerator.gather(idx).tolist()
            splits.append(list(model.plan.local_batches))
        epochs.append(seen)
    return {"epoch_samples": [sorted(e) for e in epochs], "splits": splits}


class _OomInBackward(torch.autograd.Function):
    """The identity; its backward raises CUDA's out-of-memory error on rank 1 for more than
    15 samples, from inside autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1 and len(grad) > 15:
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory in backward")
        return grad


class OomInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _OomInBackward.apply(x)
        return out


def oom_in_backward(accelerator: CannikinAccelerator) -> dict[str, Any]:
    """An epoch of steps of 40, rank 1 out of memory in backward above 15 samples:
    ``accelerator.backward`` redoes the step; every sample once."""
    net = nn.Sequential(*classifier(), OomInBackward())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(blobs(160), batch_size=40, seed=5)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    seen: list[int] = []
    for x, y, idx in loader:
        optimizer.zero_grad()
        before = model.step
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        if model.step > before:
            seen += accelerator.gather(idx).tolist()
    return {"samples": sorted(seen), "cap": model.planner.config.caps[1]}


def idle_reduce(accelerator: CannikinAccelerator) -> dict[str, Any]:
    """reduce(loss, "mean") of a step where rank 0 has no samples (its mean loss is NaN, the
    mean of nothing): the step's mean loss, rank 1's."""
    net = classifier()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = HeteroDataLoader(blobs(), batch_size=32, seed=5)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    model.pin_split([0, 32])
    x, y, _ = next(iter(loader))
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    reduced = float(accelerator.reduce(loss.detach(), reduction="mean"))
    gathered = accelerator.gather_for_metrics(y)  # rank 0 has no rows
    optimizer.step()
    losses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(losses, float(loss))
    return {"reduced": reduced, "losses": losses, "gathered": len(gathered)}


def options_reach_the_model() -> dict[str, Any]:
    """Four epochs at the even split (16/16) with ``hook_free`` and ``allow_idle`` each way:
    whether each step ran through the hook-free twin (one not measured, once the planner
    measures every few steps), and whether the planner may plan a worker 0 samples."""
    found = {}
    for hook_free in (True, False):
        accelerator = CannikinAccelerator(cpu=True, split="even", hook_free=hook_free,
                                          allow_idle=not hook_free)
        net = classifier()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        loader = HeteroDataLoader(blobs(), batch_size=32, seed=5)
        model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
        twin = []
        for x, y, _ in (batch for _ in range(4) for batch in loader):
            optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            twin.append(model._cycle.hook_free)
            optimizer.step()
        found[f"hook_free={hook_free}"] = {"twin": twin,
                                           "allow_zero": model.planner.config.allow_zero}
    return found


def main() -> None:
    torch.set_num_threads(1)
    out, folder = Path(sys.argv[1]), Path(sys.argv[2])
    accelerator = CannikinAccelerator(cpu=True, split="even", max_local_batch=[5, None],
                                      recover_backward_oom=True)
    data = blobs()
    net = classifier()
    reference = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    loader = HeteroDataLoader(data, batch_size=32, seed=3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, loader, schedule = accelerator.prepare(net, optimizer, loader, schedule)
    worst, loss_err, splits, gathered_in_order = 0.0, 0.0, [], True
    for step, (x, y, idx) in enumerate(loader):
        optimizer.zero_grad()
        with accelerator.accumulate(model):  # Accelerate's loop shape (one pass a step)
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, idx.tolist())
        in_rank_order = [i for part in everyone for i in part]
        # uneven local batches: Accelerate's own gather aborts the job here
        gathered = accelerator.gather_for_metrics((idx, y))
        gathered_in_order &= (gathered[0].tolist() == in_rank_order
                              and gathered[1].tolist() == data.tensors[1][in_rank_order].tolist())
        reduced = float(accelerator.reduce(loss.detach(), reduction="mean"))
        union = torch.tensor(sorted(in_rank_order))
        reference.zero_grad()
        reference_loss = F.cross_entropy(reference(data.tensors[0][union]), data.tensors[1][union])
        reference_loss.backward()
        loss_err = max(loss_err, abs(reduced - float(reference_loss)) / float(reference_loss))
        scale = max(float(q.grad.abs().max()) for q in reference.parameters())
        worst = max(worst, max(float((p.grad - q.grad).abs().max())
                               for p, q in zip(net.parameters(), reference.parameters(),
                                               strict=True)) / scale)
        splits.append([len(part) for part in everyone])
        optimizer.step()
        schedule.step()
        if step == 5:
            break
    schedule_steps = schedule.scheduler.last_epoch
    location = accelerator.save_state(str(folder / "state"))
    saved = json.loads((Path(location) / STATE_FILE).read_text())
    for step, (x, y, _) in enumerate(loader):  # two more steps, then back to the saved state
        optimizer.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        if step == 1:
            break
    after = model.step
    accelerator.load_state(location)
    speeds = follow_speeds(accelerator)
    oom = oom_in_backward(accelerator)
    idle = idle_reduce(accelerator)
    options = options_reach_the_model()
    refused = {}
    try:
        CannikinAccelerator(cpu=True, gradient_accumulation_steps=2)
    except ValueError as error:
        refused["accumulation"] = str(error)
    try:
        other = classifier()
        accelerator.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    except ValueError as error:
        refused["no_loader"] = str(error)
    results = {"rel_err": worst, "splits": splits, "loss_err": loss_err,
               "gathered_in_order": gathered_in_order, "schedule_steps": schedule_steps,
               "speeds": speeds, "oom": oom, "idle": idle, "options": options,
               "unwrapped_is_net": accelerator.unwrap_model(model) is net,
               "saved_step": saved[0]["runtime"]["step"], "step_before_load": after,
               "step_after_load": model.step, "refused": refused,
               "is_hdp": isinstance(model, HeteroDataParallel)}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
