"""What a change of batch size costs the steps after it, in plain torch (no Cannikin).

Cannikin changes a worker's local batch when it re-plans, probes or tries a split, and its
model predicts a settled step. This benchmark times the MLP of ``bench_real``
(64-1024-1024-10, SGD with momentum, one thread) at a batch of ``--batch`` samples in
blocks of ``--block`` steps, each block after ``--block`` steps at the same size or at
``--other`` samples, the two orders alternating round by round so that the load of a
shared machine hits both alike. It prints the CPU per step by position in the block
(median over rounds): the first steps after a change pay for it, and the rest of the block
shows how long that lasts. Figures only, no asserts (docs/runtime.md, "A change of batch
size costs the steps after it").

Run: ``python benchmarks/bench_batch_change.py [--batch 160] [--other 373] [--rounds 60]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 1024


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 10))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=160, help="the batch timed")
    parser.add_argument("--other", type=int, default=373, help="the batch changed from")
    parser.add_argument("--block", type=int, default=9, help="steps per block")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    for name in ("batch", "other", "block", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be >= 1")
    torch.set_num_threads(1)
    net = _mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(0)

    def step(batch: int) -> None:
        x = torch.randn(batch, 64, generator=generator)
        y = torch.randint(0, 10, (batch,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()

    for _ in range(20):
        step(args.batch)
    cpu: dict[int, list[list[float]]] = {args.batch: [], args.other: []}
    for round_ in range(args.rounds):
        order = (args.batch, args.other) if round_ % 2 else (args.other, args.batch)
        for before in order:
            for _ in range(args.block):
                step(before)
            timed = []
            for _ in range(args.block):
                start = time.process_time()
                step(args.batch)
                timed.append(time.process_time() - start)
            cpu[before].append(timed)
    print(f"CPU per step (ms) at a batch of {args.batch}, by position after {args.block} "
          f"steps at each size (median over {args.rounds} rounds):")
    for before, blocks in cpu.items():
        medians = [1e3 * statistics.median(column) for column in zip(*blocks, strict=True)]
        print(f"  after {before:4d}: " + " ".join(f"{m:6.2f}" for m in medians)
              + f"   mean {statistics.fmean(medians):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
