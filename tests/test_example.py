"""examples/train_mlp.py runs under torchrun with emulated speeds and learns."""

from __future__ import annotations

import re

import pytest

from dist_utils import ROOT, run_torchrun


def test_train_mlp_example_runs_and_learns() -> None:
    result = run_torchrun(ROOT / "examples" / "train_mlp.py", nproc=2,
                          script_args=["--epochs", "2", "--batch-size", "64"],
                          timeout_s=120.0, env={"CANNIKIN_SLOWDOWN": "2,1"}).check()
    # nccl only where each of the 2 processes has a GPU of its own
    assert re.search(r"2 workers, backend (gloo, device cpu|nccl, device cuda:0)",
                     result.stdout), result.stdout
    losses = [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 2, result.stdout
    assert losses[1] < losses[0] < 2.31  # below chance (ln 10) after one epoch, then lower
    split = re.findall(r"split \[(\d+), (\d+)\]", result.stdout)[-1]
    assert int(split[1]) > int(split[0])  # rank 1 is twice as fast: it gets more


def test_beyond_memory_example_accumulates_and_learns() -> None:
    result = run_torchrun(ROOT / "examples" / "train_beyond_memory.py", nproc=2,
                          script_args=["--epochs", "2", "--max-local-batch", "16"],
                          timeout_s=120.0, env={"CANNIKIN_SLOWDOWN": "2,1"}).check()
    losses = [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] < 2.31, result.stdout
    split = [int(v) for v in re.findall(r"split \[(\d+), (\d+)\]", result.stdout)[-1]]
    assert sum(split) == 192 and split[1] > split[0] > 16  # beyond one pass on both
    # 1797 digits: 10 steps an epoch (9 of 192, one of 69), each in passes of <= 16
    passes = [int(p) for p in re.findall(r"rank \d epoch 1: (\d+) micro-batches",
                                         result.stdout)]
    assert len(passes) == 2 and sum(passes) >= 1797 // 16 and min(passes) > 10, result.stdout


def _epochs(stdout: str) -> list[tuple[float, list[int]]]:
    """Each ``epoch N: loss L ... split [a, b]`` line's loss and split."""
    rows = re.findall(r"epoch \d+: loss ([0-9.]+).*split \[(\d+), (\d+)\]", stdout)
    return [(float(loss), [int(a), int(b)]) for loss, a, b in rows]


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_framework_example_learns_with_the_split_following_the_speeds(framework: str) -> None:
    pytest.importorskip(framework, reason=f"the {framework} extra is not installed")
    result = run_torchrun(ROOT / "examples" / f"train_{framework}.py", nproc=2,
                          script_args=["--epochs", "2"], timeout_s=180.0,
                          env={"CANNIKIN_SLOWDOWN": "2,1"}).check()
    epochs = _epochs(result.stdout)
    assert len(epochs) == 2, result.stdout
    (first, _), (second, split) = epochs
    assert second < first < 2.31, result.stdout  # below chance (ln 10), then lower
    assert split[1] > split[0] > 0 and sum(split) == 64  # rank 1 is twice as fast
