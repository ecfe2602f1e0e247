"""A quota worker for test_quota: join this rank's CPU-quota group, run a few training steps
(HeteroDataParallel, even split), then time the same local compute on every rank (forward
and backward of a model of its own, no collective), and print (rank 0) each rank's share,
group, compute time and the cores it reads as its own limit as one JSON line.

Not plain DDP: on torch 2.13 its built-in hook's all-reduces, launched inside the backward,
carry the backward's Python context in their work, and a throttled gloo thread that drops it
after the interpreter began finalising aborts the process (``terminate called without an
active exception``; once in 8 suite runs beside a CPU hog, on the 25% rank). Cannikin's hook
launches them without it (docs/runtime.md, "Exit").

The timed compute is ~100 ms at a whole core, many CFS periods: a burst shorter than the
quota (a 2-5 ms forward after an all-reduce wait, which refills the quota) runs at full speed
even in a 25% group, so short timings inside a DDP step do not show the quota."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.quota import join_from_env, own_cpu_limit

STEPS = 5
BATCH = 256
TIMED = 6
"""Forward and backward passes timed per rank, at batch 2 x BATCH."""


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def main() -> None:
    rank = int(os.environ["RANK"])
    share = join_from_env(rank)  # after the imports: start-up is not what is measured
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    net = _mlp()
    x, y = torch.randn(BATCH * world * STEPS, 64), torch.randint(0, 10, (BATCH * world * STEPS,))
    loader = HeteroDataLoader(TensorDataset(x, y), batch_size=BATCH * world)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = HeteroDataParallel(net, opt, loader, split="even", slowdown=None)
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    model.remove_hooks()
    local = _mlp()  # DDP's hooks sit on net's parameters: time a model of this rank's own
    x2, y2 = torch.cat([x[:BATCH], x[:BATCH]]), torch.cat([y[:BATCH], y[:BATCH]])
    dist.barrier()
    start = time.perf_counter()
    for _ in range(TIMED):
        F.cross_entropy(local(x2), y2).backward()
    compute_s = time.perf_counter() - start
    cpu_line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if "cpu" in line.split(":")[1].split(",") or line.startswith("0::"))
    rows: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (share, cpu_line.split(":", 2)[2], compute_s, own_cpu_limit()))
    if rank == 0:
        shares, groups, times, limits = zip(*rows, strict=True)
        print(json.dumps({"shares": shares, "groups": groups, "compute_s": times,
                          "cpu_limits": limits}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
