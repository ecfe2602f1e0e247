"""A plain-DDP training script in the usual tutorial shape (a Trainer class with snapshots,
``set_epoch``, an eval loop, gradient clipping and an LR scheduler), trained on
scikit-learn's bundled digits. ``cannikin_trainer.py`` beside it is the same script ported
to Cannikin: ``diff -u ddp_trainer.py cannikin_trainer.py`` is the whole port.

    torchrun --standalone --nproc-per-node=2 examples/port/ddp_trainer.py --epochs 3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def datasets() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


class Trainer:
    def __init__(self, net: nn.Module, train: TensorDataset, test: TensorDataset,
                 batch_size: int, snapshot: Path) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.snapshot = snapshot
        self.epochs_run = 0
        if snapshot.exists():
            state = torch.load(snapshot, weights_only=True)
            net.load_state_dict(state["model"])
            self.epochs_run = state["epochs_run"]
        self.train_data = DataLoader(train, batch_size=batch_size,
                                     sampler=DistributedSampler(train))
        self.test = test
        self.optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        self.model = DDP(net)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()
        return float(loss.detach()) * len(source) if len(source) else 0.0

    def _run_epoch(self, epoch: int) -> float:
        self.train_data.sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for source, targets in self.train_data:
            total += torch.tensor([self._run_batch(source, targets), float(len(source))])
        dist.all_reduce(total)
        return float(total[0] / total[1])

    def _evaluate(self) -> float:
        self.model.eval()
        with torch.no_grad():
            x, y = self.test.tensors
            accuracy = float((self.model(x).argmax(dim=1) == y).float().mean())
        self.model.train()
        return accuracy

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            self.scheduler.step()
            accuracy = self._evaluate()
            if self.rank == 0:
                print(f"epoch {epoch}: training loss {loss:.4f}, held-out accuracy "
                      f"{accuracy:.3f}", flush=True)
                torch.save({"model": self.model.module.state_dict(), "epochs_run": epoch + 1},
                           self.snapshot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--snapshot", type=Path, default=Path("snapshot.pt"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    train, test = datasets()
    Trainer(net, train, test, args.batch_size, args.snapshot).train(args.epochs)
    dist.destroy_process_group()
    # torch 2.13: DDP's gloo work keeps the backward's Python context; dropped at exit, it aborts
    time.sleep(0.5)  # let the gloo threads drop it first (an abort unlikely, not impossible)


if __name__ == "__main__":
    main()
