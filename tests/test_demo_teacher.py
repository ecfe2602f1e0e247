"""The demo's teacher task: seeded samples, labels drawn from the teacher's softmax, a ceiling
no model passes, and a gradient noise scale that grows as the student trains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cannikin.demo import teacher
from cannikin.demo.config import DemoConfig
from cannikin.demo.model import make_model

LR, MOMENTUM, BATCH = 0.05, 0.9, 64  # the demo's SGD at B0


def _split(path: Path, seed: int) -> dict[str, np.ndarray]:
    assert teacher.save_teacher_split(path, seed) == teacher.TRAIN_SIZE
    with np.load(path) as arrays:
        return dict(arrays)


def _softmax(logits: np.ndarray) -> np.ndarray:
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    result: np.ndarray = p / p.sum(axis=1, keepdims=True)
    return result


def test_the_samples_follow_the_seed_and_the_teacher_does_not(tmp_path: Path) -> None:
    a, again, b = (_split(tmp_path / f"{i}.npz", seed) for i, seed in enumerate((0, 0, 1)))
    assert a["x_train"].shape == (teacher.TRAIN_SIZE, teacher.FEATURES)
    assert a["x_test"].shape == (teacher.TEST_SIZE, teacher.FEATURES)
    assert a["x_train"].dtype == np.float32 and a["y_train"].dtype == np.int64
    assert set(np.unique(a["y_train"])) == set(range(teacher.CLASSES))
    for name in a:
        np.testing.assert_array_equal(a[name], again[name])
    assert not np.array_equal(a["x_train"], b["x_train"])
    # the same task for both seeds: the teacher's argmax agrees as often with either's labels
    agree = [np.mean((s["x_train"] @ teacher.teacher_weights()).argmax(1) == s["y_train"])
             for s in (a, b)]
    assert abs(agree[0] - agree[1]) < 0.03


def test_labels_are_drawn_from_the_teachers_softmax(tmp_path: Path) -> None:
    """Against the softmax computed here: the labels agree with the teacher's most likely
    class as often as its mean top probability says (not always, as argmax labels would),
    and each class is as frequent as its mean probability."""
    split = _split(tmp_path / "s.npz", 0)
    x = np.concatenate([split["x_train"], split["x_test"]]).astype(np.float64)
    y = np.concatenate([split["y_train"], split["y_test"]])
    p = _softmax(x @ teacher.teacher_weights())
    n = len(y)
    expected = p.max(axis=1).mean()
    assert 0.8 < expected < 0.9
    assert abs(np.mean(p.argmax(axis=1) == y) - expected) < 4 * np.sqrt(0.25 / n)
    frequencies = np.bincount(y, minlength=teacher.CLASSES) / n
    np.testing.assert_allclose(frequencies, p.mean(axis=0), atol=4 * np.sqrt(0.25 / n))


def test_softmax_regression_nears_the_ceiling_without_memorising(tmp_path: Path) -> None:
    """scikit-learn's softmax regression, fitted to convergence: held-out accuracy near the
    teacher's own, training accuracy no higher (the demo's model cannot memorise)."""
    from sklearn.linear_model import LogisticRegression

    split = _split(tmp_path / "s.npz", 0)
    fit = LogisticRegression(C=1e4, max_iter=1000).fit(split["x_train"], split["y_train"])
    best = np.mean(_softmax(split["x_test"] @ teacher.teacher_weights()).argmax(1)
                   == split["y_test"])
    assert fit.score(split["x_test"], split["y_test"]) > best - 0.025
    assert fit.score(split["x_train"], split["y_train"]) < best + 0.03


def _noise_scale(net: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> float:
    """tr(Sigma) / |G|^2 over the training set, from softmax regression's per-sample gradient
    in closed form: (p - onehot(y)) times the input with a 1 for the bias."""
    with torch.no_grad():
        residual = torch.softmax(net(x), dim=1) - F.one_hot(y, teacher.CLASSES)
        inputs = torch.cat([x, torch.ones(len(x), 1)], dim=1)
        per_sample = residual[:, :, None] * inputs[:, None, :]  # (n, classes, features + 1)
        mean = per_sample.mean(dim=0)
        grad_sqr = float((mean**2).sum())
        variance = float((per_sample**2).sum(dim=(1, 2)).mean()) - grad_sqr
    return variance / grad_sqr


def test_the_closed_form_gradient_is_autograds(tmp_path: Path) -> None:
    split = _split(tmp_path / "s.npz", 0)
    x, y = torch.from_numpy(split["x_train"][:256]), torch.from_numpy(split["y_train"][:256])
    torch.manual_seed(0)
    net = make_model("teacher")
    assert isinstance(net, torch.nn.Linear)
    F.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
    assert net.weight.grad is not None and net.bias.grad is not None
    with torch.no_grad():
        residual = torch.softmax(net(x), dim=1) - F.one_hot(y, teacher.CLASSES)
    torch.testing.assert_close(net.weight.grad, residual.T @ x / len(x))
    torch.testing.assert_close(net.bias.grad, residual.mean(dim=0))


def test_the_noise_scale_grows_as_the_student_trains(tmp_path: Path) -> None:
    """What the task is for: with the demo's SGD at B0 = 64 the noise scale grows several
    times over the first few hundred steps, and ends in the thousands (the digits CNN's true
    noise scale reaches 120-365, ``benchmarks/bench_gns_lag.py``)."""
    split = _split(tmp_path / "s.npz", 0)
    x, y = torch.from_numpy(split["x_train"]), torch.from_numpy(split["y_train"])
    torch.manual_seed(0)
    net = make_model("teacher")
    assert isinstance(net, torch.nn.Linear)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True)
    order = torch.randperm(len(y))
    scales = {}
    for step in range(400):
        if step in (20, 399):
            scales[step] = _noise_scale(net, x, y)
        batch = order[(step * BATCH) % len(y):][:BATCH]
        optimizer.zero_grad()
        F.cross_entropy(net(x[batch]), y[batch]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    assert scales[20] > BATCH and scales[399] > 3 * scales[20], scales


def test_the_task_is_validated() -> None:
    assert DemoConfig(task="teacher", epochs=1).task == "teacher"
    with pytest.raises(ValueError, match="task 'mnist' is not valid: give one of digits, "
                                         "teacher"):
        DemoConfig(task="mnist", epochs=1)
    with pytest.raises(ValueError, match="task 'mnist' is not valid"):
        make_model("mnist")
