"""Minimal Cannikin training script: the drop-in change from DistributedDataParallel.

Run on one machine with emulated heterogeneous workers (speeds 4, 2, 1 -> slowdowns)::

    CANNIKIN_SLOWDOWN=4,2,1 torchrun --standalone --nproc-per-node=3 examples/train_mlp.py

On real machines drop CANNIKIN_SLOWDOWN and launch with torchrun as usual. Trains an
MLP on scikit-learn's bundled handwritten digits (no download).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.log import setup_logging
from cannikin.runtime import HeteroDataLoader, HeteroDataParallel, init_distributed


class PrintEvery:
    """A metrics sink: one line every ``every`` steps (rank 0 only calls it)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def log(self, metrics: dict, step: int) -> None:
        if step % self.every == 0:
            pred = metrics["predicted_step_time_s"]
            print(f"step {step:4d}  split {metrics['local_batches']}  "
                  f"step {metrics['step_time_s'] * 1e3:6.1f} ms  predicted "
                  f"{'   n/a' if pred is None else f'{pred * 1e3:6.1f}'} ms", flush=True)


def digits() -> TensorDataset:
    """scikit-learn's bundled 8x8 handwritten digits, pixels scaled to [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return TensorDataset(x, torch.tensor(data.target))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=96, help="initial total batch B0")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="let the total batch grow by goodput up to this")
    parser.add_argument("--split", choices=["optimal", "even"], default="optimal")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.set_num_threads(1)
    ctx = init_distributed()
    setup_logging(ctx.rank)
    if ctx.rank == 0:
        print(f"{ctx.world_size} workers, backend {ctx.backend}, device {ctx.device}", flush=True)
    dataset = digits()

    loader = HeteroDataLoader(dataset, batch_size=args.batch_size, seed=0)
    if args.max_batch_size is not None:
        loader.autoscale_batch_size(args.max_batch_size, local_bsz_bounds=(1, None))
    net = mlp().to(ctx.device)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    model = HeteroDataParallel(net, optimizer, loader, split=args.split,
                               metrics=PrintEvery(10))

    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for xb, yb in loader:
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            model.backward(loss)  # loss.backward(), the weight b_i / B in its seed
            optimizer.step()
            if len(xb):  # none on a worker the plan idles (loss NaN), or in a tiny last batch
                total, count = total + float(loss.detach()) * len(xb), count + len(xb)
        mean = torch.tensor([total, float(count)], device=ctx.device)
        torch.distributed.all_reduce(mean)
        if ctx.rank == 0:
            print(f"epoch {epoch}: loss {mean[0].item() / mean[1].item():.4f}  "
                  f"split {list(model.plan.local_batches)}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
