"""A synthetic task whose gradient noise scale grows as it trains (numpy only, no download).

A fixed random linear teacher labels Gaussian inputs *at random*, with the softmax of its
logits, and the student is softmax regression on the same inputs (one linear layer,
:func:`cannikin.demo.model.make_model`). On the digits the CNN can fit every training
label, so the gradient's mean |G|^2 and its per-sample variance tr(Sigma) fall together and
the noise scale tr(Sigma)/|G|^2 stays in the low hundreds (``benchmarks/bench_gns_lag.py``),
too little for the emulated demo's batch to grow. Here no model beats the teacher (about
86% held-out accuracy, a loss above 0) and 650 parameters cannot memorise 8192 samples: as
the student nears the optimum |G|^2 goes to 0 while tr(Sigma) stays, so the noise scale grows
through training and the goodput-chosen batch with it. The input variances are spread over a
decade so the low-variance directions keep training going for hundreds of steps.

The teacher is part of the task (the same for every seed); the seed draws the samples.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

FEATURES = 64
CLASSES = 10
TRAIN_SIZE = 8192
TEST_SIZE = 4096
TEACHER_SEED = 14
"""Seed of the teacher's weights: fixed, so that every ``--seed`` trains the same task."""
LOGIT_SCALE = 8.0
"""Standard deviation of each teacher logit; 8 gives a best accuracy of about 86%."""
INPUT_STD = (2.0, 2.0 / math.sqrt(10.0))
"""Standard deviation of the first and the last input feature (geometric in between): the
variances span 10x, so SGD at the demo's learning rate needs a few hundred steps of 64."""


def input_std() -> np.ndarray:
    """Standard deviation of each input feature."""
    return np.geomspace(INPUT_STD[0], INPUT_STD[1], FEATURES)


def teacher_weights() -> np.ndarray:
    """The teacher's (FEATURES, CLASSES) weights: every feature adds the same logit variance
    (weights scaled by the inverse of its standard deviation), ``LOGIT_SCALE**2`` in all."""
    rng = np.random.default_rng(TEACHER_SEED)
    weights = rng.normal(size=(FEATURES, CLASSES)) * LOGIT_SCALE / math.sqrt(FEATURES)
    result: np.ndarray = weights / input_std()[:, None]
    return result


def draw(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` inputs (float32, shape (n, FEATURES)) and labels drawn from the teacher's
    softmax."""
    x = rng.normal(size=(n, FEATURES)) * input_std()
    logits = x @ teacher_weights()
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    cumulative = p.cumsum(axis=1)
    labels = (cumulative > rng.random((n, 1)) * cumulative[:, -1:]).argmax(axis=1)
    return x.astype(np.float32), labels.astype(np.int64)


def save_teacher_split(path: Path, seed: int) -> int:
    """Write ``TRAIN_SIZE`` training and ``TEST_SIZE`` held-out samples drawn with ``seed``
    to ``path`` (the arrays of :func:`cannikin.demo.digits.save_digits_split`). Returns the
    number of training samples."""
    rng = np.random.default_rng(seed)
    x_train, y_train = draw(TRAIN_SIZE, rng)
    x_test, y_test = draw(TEST_SIZE, rng)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return TRAIN_SIZE
