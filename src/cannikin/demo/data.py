"""scikit-learn's bundled handwritten digits (1797 images of 8x8), split once, offline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

TEST_FRACTION = 0.2


@dataclass(frozen=True, kw_only=True)
class DigitsSplit:
    """Training and held-out tensors; the training set also yields each sample's index, so
    the demo can count which samples every epoch saw."""

    train: TensorDataset  # (image, label, index)
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def train_x(self) -> torch.Tensor:
        return self.train.tensors[0]

    @property
    def train_y(self) -> torch.Tensor:
        return self.train.tensors[1]


def load_digits_split(seed: int) -> DigitsSplit:
    """Stratified 80/20 split; pixels scaled to [0, 1], shaped (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=TEST_FRACTION, random_state=seed,
        stratify=digits.target,
    )

    def images(a: object) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.float32).unsqueeze(1) / 16.0

    def labels(a: object) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.long)

    train_x, train_y = images(x_train), labels(y_train)
    return DigitsSplit(
        train=TensorDataset(train_x, train_y, torch.arange(len(train_y))),
        test_x=images(x_test),
        test_y=labels(y_test),
    )
