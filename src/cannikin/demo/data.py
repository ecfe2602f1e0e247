"""The task's split as torch tensors, for the workers (saved by :mod:`cannikin.demo.digits` or
:mod:`cannikin.demo.teacher`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset


@dataclass(frozen=True, kw_only=True)
class DataSplit:
    """Training and held-out tensors; the training set also yields each sample's index, so
    the demo can count which samples every epoch saw."""

    train: TensorDataset  # (input, label, index)
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def train_x(self) -> torch.Tensor:
        return self.train.tensors[0]

    @property
    def train_y(self) -> torch.Tensor:
        return self.train.tensors[1]


def load_split(path: Path) -> DataSplit:
    with np.load(path) as arrays:
        train_x, train_y = torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"])
        return DataSplit(
            train=TensorDataset(train_x, train_y, torch.arange(len(train_y))),
            test_x=torch.from_numpy(arrays["x_test"]),
            test_y=torch.from_numpy(arrays["y_test"]),
        )
