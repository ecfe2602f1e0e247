"""Hugging Face Accelerate with Cannikin: ``CannikinAccelerator`` in place of
``Accelerator`` and the training data as a ``HeteroDataLoader`` (its batch size the total).

Trains an MLP on scikit-learn's bundled handwritten digits (no download) with a linear LR
schedule and an evaluation each epoch. With emulated speeds 2:1 on one machine::

    CANNIKIN_SLOWDOWN=2,1 cannikin launch --standalone --nproc-per-node=2 \
        examples/train_accelerate.py --epochs 3

Needs the accelerate extra (``pip install -e '.[accelerate]'``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cannikin.integrations.accelerate import CannikinAccelerator
from cannikin.log import setup_logging
from cannikin.runtime import HeteroDataLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="total over all ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.set_num_threads(1)
    accelerator = CannikinAccelerator(cpu=True)          # was: Accelerator(cpu=True)
    setup_logging(accelerator.process_index)             # Cannikin's plans, on rank 0
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train, held_out = TensorDataset(x[:1437], y[:1437]), TensorDataset(x[1437:], y[1437:])
    loader = HeteroDataLoader(train, batch_size=args.batch_size, seed=0)  # was: DataLoader
    evaluation = DataLoader(held_out, batch_size=64)     # sharded by Accelerate, as usual
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # one scheduler step per optimizer step: sized by len(loader), as the loader's steps
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1,
                                                 total_iters=len(loader) * args.epochs)
    model, optimizer, loader, evaluation, schedule = accelerator.prepare(
        model, optimizer, loader, evaluation, schedule)
    for epoch in range(args.epochs):
        model.train()
        losses = []
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            losses.append(accelerator.reduce(loss.detach(), reduction="mean"))  # step's mean
            optimizer.step()
            schedule.step()
        model.eval()
        correct = count = 0
        for xb, yb in evaluation:
            with torch.no_grad():
                predicted, labels = accelerator.gather_for_metrics((model(xb).argmax(-1), yb))
            correct, count = correct + int((predicted == labels).sum()), count + len(labels)
        accelerator.print(f"epoch {epoch}: loss {float(torch.stack(losses).mean()):.4f}  "
                          f"held-out accuracy {correct / count:.3f}  "
                          f"lr {schedule.get_last_lr()[0]:.4f}  "
                          f"split {list(model.plan.local_batches)}")


if __name__ == "__main__":
    main()
