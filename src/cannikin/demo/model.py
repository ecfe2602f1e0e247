"""The demo's networks, one per task (they never touch torch.distributed)."""

from __future__ import annotations

import torch
from torch import nn

from cannikin.demo import teacher
from cannikin.demo.config import TASKS


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers (about 38k parameters)."""

    def __init__(self, channels: int = 16, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden), nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.features(x))
        return logits


def make_model(task: str) -> nn.Module:
    """The network of ``task`` (see :data:`cannikin.demo.config.TASKS`): the CNN for the
    digits, softmax regression (one linear layer) for the teacher's samples."""
    if task == "digits":
        return DigitsCNN()
    if task == "teacher":
        return nn.Linear(teacher.FEATURES, teacher.CLASSES)
    raise ValueError(f"task {task!r} is not valid: give one of {', '.join(TASKS)}")
