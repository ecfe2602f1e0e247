"""The floor of a Python comm hook: CPU per step of plain DDP, of DDP with the smallest
Python hook that weights a bucket, and of HeteroDataParallel, side by side.

On a CPU-quota worker every ms of the runtime's CPU costs 1 / share ms of the step
(docs/runtime.md, real heterogeneity). Part of that CPU is not Cannikin's code but the
price of having a Python comm hook at all: DDP then calls into Python for every bucket
and waits on a Python future, where its own hook runs in C++. This benchmark splits the
runtime's cost over plain DDP into that floor and the rest, in one process (world 1,
gloo, one thread), with the same MLP as ``bench_real`` (64-1024-1024-10, two buckets):

* ``ddp``: plain DistributedDataParallel, a batch gathered from a shuffled order;
* ``python hook``: the same with ``bucket *= w`` and an async all-reduce, the future
  unwrapped by ``.then`` (``torch.distributed.algorithms.ddp_comm_hooks``' pattern);
* ``cannikin hook``: the same with Cannikin's hook (``runtime/comm.py``), driven as the
  runtime drives it (a weight and the exchange rows set before the step, read after);
* ``cannikin``: HeteroDataParallel with its split pinned (no planning), its own loader.

Blocks of steps alternate in a shuffled order each round; each figure is the median over
rounds of the main thread's CPU per step, and the differences are per round, so the load
of a shared machine hits all alike. Figures only, no asserts.

Run: ``python benchmarks/bench_hook.py [--batch 160] [--rounds 30]``.
"""

# No `from __future__ import annotations`: DDP checks the hook signature at run time.

import argparse
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel  # noqa: E402
from cannikin.runtime.comm import CommState, weighted_allreduce_hook  # noqa: E402
from cannikin.runtime.planner import REPORT_SIZE  # noqa: E402
from cannikin.runtime.timing import CpuClock  # noqa: E402

WIDTH = 1024
WEIGHT = 0.5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 10))


def _python_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    buffer.mul_(WEIGHT)
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    unwrapped: torch.futures.Future[torch.Tensor] = work.get_future().then(
        lambda fut: fut.value()[0])
    return unwrapped


def _gathered(x: torch.Tensor, y: torch.Tensor, batch: int) -> Iterator[tuple[torch.Tensor, ...]]:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    start = 0
    while True:
        index = order[torch.arange(start, start + batch) % len(order)]
        start = (start + batch) % len(order)
        yield x[index], y[index]


def _steps(batch: int) -> dict[str, Callable[[], None]]:
    """One training step of each configuration, on its own model and optimizer."""
    x = torch.randn(8 * batch, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8 * batch,), generator=torch.Generator().manual_seed(2))

    state = CommState(clock=CpuClock(), capture_sqnorm=False)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any],
             comm: CommState | None = None) -> Callable[[], None]:
        def run() -> None:
            inputs, targets = next(batches)
            if comm is not None:
                comm.begin_step(WEIGHT)
                comm.rows = np.zeros((1, REPORT_SIZE))
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            if comm is not None:
                comm.read_step(norms=False)
            optimizer.step()
        return run

    configurations: dict[str, Callable[[], None]] = {}
    for name in ("ddp", "python hook", "cannikin hook"):
        net = _mlp()
        ddp = DistributedDataParallel(net)
        if name == "python hook":
            ddp.register_comm_hook(None, _python_hook)
        if name == "cannikin hook":
            ddp.register_comm_hook(state, weighted_allreduce_hook)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        configurations[name] = step(ddp, optimizer, _gathered(x, y, batch),
                                    state if name == "cannikin hook" else None)
    net = _mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loader = HeteroDataLoader(TensorDataset(x, y), batch_size=batch, seed=0)
    model = HeteroDataParallel(net, optimizer, loader, slowdown=None)
    model.pin_split([batch])
    configurations["cannikin"] = step(model, optimizer, (b for _ in iter(int, 1) for b in loader))
    return configurations


def _block_ms(run: Callable[[], None], steps: int) -> float:
    start = time.thread_time()
    for _ in range(steps):
        run()
    return (time.thread_time() - start) / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=160, help="samples per step")
    parser.add_argument("--rounds", type=int, default=30, help="blocks per configuration")
    parser.add_argument("--block-steps", type=int, default=20, help="steps per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        configurations = _steps(args.batch)
        for run in configurations.values():  # warm the allocator and DDP's bucket rebuild
            _block_ms(run, 3 * args.block_steps)
        shuffle = random.Random(0)
        per_round: dict[str, list[float]] = {name: [] for name in configurations}
        for _ in range(args.rounds):
            names = list(configurations)
            shuffle.shuffle(names)
            for name in names:
                per_round[name].append(_block_ms(configurations[name], args.block_steps))
    finally:
        dist.destroy_process_group()
    base = per_round["ddp"]
    print(f"bench_hook: MLP 64-{WIDTH}-{WIDTH}-10, batch {args.batch}, one process, "
          f"{args.rounds} rounds of {args.block_steps} steps; main thread CPU per step")
    print(f"{'configuration':<14}{'ms/step':>9}{'over DDP':>10}{'IQR of the difference':>26}")
    for name, times in per_round.items():
        over = [t - b for t, b in zip(times, base, strict=True)]
        q1, _, q3 = statistics.quantiles(over, n=4)
        print(f"{name:<14}{statistics.median(times):>9.3f}{statistics.median(over):>+10.3f}"
              f"{q1:>+17.3f} to {q3:+.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
