"""scikit-learn's bundled handwritten digits (1797 images of 8x8), split once, offline.

The parent process splits the data and saves it as one ``.npz`` file, so the workers load
plain numpy arrays instead of each importing scikit-learn (seconds of CPU per worker on a
small machine). No torch here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TEST_FRACTION = 0.2


def save_digits_split(path: Path, seed: int) -> int:
    """Write a stratified 80/20 split to ``path``; pixels scaled to [0, 1], shaped
    (N, 1, 8, 8). Returns the number of training samples."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=TEST_FRACTION, random_state=seed,
        stratify=digits.target,
    )

    def images(a: np.ndarray) -> np.ndarray:
        return (a[:, None, :, :] / 16.0).astype(np.float32)

    np.savez(path, x_train=images(x_train), y_train=y_train.astype(np.int64),
             x_test=images(x_test), y_test=y_test.astype(np.int64))
    return len(y_train)
