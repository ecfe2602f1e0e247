"""Batches beyond a worker's memory: each worker runs its share of a step in micro-batches
of at most its cap, as many as it needs (planned per worker), gradients accumulated.

Run on one machine with emulated workers, the first twice as slow, each holding at most
16 samples per forward and backward, a total batch of 192 (six times what they hold)::

    CANNIKIN_SLOWDOWN=2,1 torchrun --standalone --nproc-per-node=2 \\
        examples/train_beyond_memory.py --max-local-batch 16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from train_mlp import PrintEvery, digits, mlp

from cannikin.log import setup_logging
from cannikin.runtime import HeteroDataLoader, HeteroDataParallel, init_distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=192, help="total batch B")
    parser.add_argument("--max-local-batch", type=int, default=16,
                        help="samples one forward and backward may hold, on every worker")
    parser.add_argument("--max-micro-batches", type=int, default=8,
                        help="most micro-batches a worker runs per step")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    ctx = init_distributed()
    setup_logging(ctx.rank)
    loader = HeteroDataLoader(digits(), batch_size=args.batch_size, seed=0)
    net = mlp().to(ctx.device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    model = HeteroDataParallel(net, optimizer, loader, max_local_batch=args.max_local_batch,
                               max_micro_batches=args.max_micro_batches, metrics=PrintEvery(10))

    for epoch in range(args.epochs):
        total, count, passes = 0.0, 0, 0
        for step in loader.steps():              # one optimizer step each, on every rank
            optimizer.zero_grad()
            for xb, yb in step:                  # this worker's micro-batches of the step
                xb, yb = xb.to(ctx.device), yb.to(ctx.device)
                loss = F.cross_entropy(model(xb), yb)   # each micro-batch's mean loss
                loss.backward()
                total, count = total + float(loss.detach()) * len(xb), count + len(xb)
                passes += 1
            optimizer.step()                     # the mean gradient over the step's B
        mean = torch.tensor([total, float(count)], device=ctx.device)
        torch.distributed.all_reduce(mean)
        print(f"rank {ctx.rank} epoch {epoch}: {passes} micro-batches of at most "
              f"{args.max_local_batch}", flush=True)
        if ctx.rank == 0:
            print(f"epoch {epoch}: loss {mean[0].item() / mean[1].item():.4f}  "
                  f"split {list(model.plan.local_batches)}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
