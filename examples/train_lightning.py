"""PyTorch Lightning with Cannikin: one argument of the Trainer changes.

Trains an MLP on scikit-learn's bundled handwritten digits (no download). Under torchrun
Lightning uses the processes torchrun started; with emulated speeds 2:1 on one machine::

    CANNIKIN_SLOWDOWN=2,1 cannikin launch --standalone --nproc-per-node=2 \
        examples/train_lightning.py --epochs 3

Needs the lightning extra (``pip install -e '.[lightning]'``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cannikin.integrations.lightning import CannikinStrategy
from cannikin.log import setup_logging


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        # weighted by each rank's share of the step: the step's mean loss
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        strategy = self.trainer.strategy
        if self.trainer.is_global_zero and isinstance(strategy, CannikinStrategy):
            print(f"epoch {self.current_epoch}: loss "
                  f"{float(self.trainer.callback_metrics['train_loss']):.4f}  "
                  f"split {list(strategy.model.plan.local_batches)}", flush=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, as with DDP")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.set_num_threads(1)
    # Cannikin's plans, on rank 0 (Lightning's own launch sets LOCAL_RANK only)
    setup_logging(int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))))
    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16.0,
                         torch.tensor(digits.target))
    torch.manual_seed(0)
    # under torchrun, the processes it started on this machine; else Lightning starts 2
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    trainer = pl.Trainer(strategy=CannikinStrategy(), accelerator="cpu", devices=devices,
                         max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DigitsClassifier(args.lr),
                DataLoader(data, batch_size=args.batch_size, shuffle=True))


if __name__ == "__main__":
    main()
