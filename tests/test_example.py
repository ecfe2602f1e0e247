"""The examples run under torchrun with emulated speeds (2:1), learn, and the planner's
choices give the faster rank the larger share."""

from __future__ import annotations

import re

import pytest

from dist_utils import ROOT, JobResult, run_torchrun


def chosen_splits(result: JobResult) -> list[list[int]]:
    """The splits the planner chose on its cadence, from its log: not the plan in force at
    the end, which may be a probe of a worker at another batch (a few steps long)."""
    found = re.findall(r"\(cadence\): B=\d+ split=\[(\d+), (\d+)\]", result.stderr)
    return [[int(a), int(b)] for a, b in found]


def losses_of(result: JobResult) -> list[float]:
    """Each ``epoch N: loss L`` line's loss."""
    return [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", result.stdout)]


def test_train_mlp_example_runs_and_learns() -> None:
    result = run_torchrun(ROOT / "examples" / "train_mlp.py", nproc=2,
                          script_args=["--epochs", "2", "--batch-size", "64"],
                          timeout_s=120.0, env={"CANNIKIN_SLOWDOWN": "2,1"}).check()
    # nccl only where each of the 2 processes has a GPU of its own
    assert re.search(r"2 workers, backend (gloo, device cpu|nccl, device cuda:0)",
                     result.stdout), result.stdout
    losses = losses_of(result)
    assert len(losses) == 2, result.stdout
    assert losses[1] < losses[0] < 2.31  # below chance (ln 10) after one epoch, then lower
    split = chosen_splits(result)[-1]
    assert split[1] > split[0]  # rank 1 is twice as fast: it gets more


def test_beyond_memory_example_accumulates_and_learns() -> None:
    result = run_torchrun(ROOT / "examples" / "train_beyond_memory.py", nproc=2,
                          script_args=["--epochs", "2", "--max-local-batch", "16"],
                          timeout_s=120.0, env={"CANNIKIN_SLOWDOWN": "2,1"}).check()
    losses = losses_of(result)
    assert len(losses) == 2 and losses[1] < losses[0] < 2.31, result.stdout
    split = chosen_splits(result)[-1]
    assert sum(split) == 192 and split[1] > split[0] > 16  # beyond one pass on both
    # 1797 digits: 10 steps an epoch (9 of 192, one of 69), each in passes of <= 16
    passes = [int(p) for p in re.findall(r"rank \d epoch 1: (\d+) micro-batches",
                                         result.stdout)]
    assert len(passes) == 2 and sum(passes) >= 1797 // 16 and min(passes) > 10, result.stdout


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_framework_example_learns_with_the_split_following_the_speeds(framework: str) -> None:
    pytest.importorskip(framework, reason=f"the {framework} extra is not installed")
    result = run_torchrun(ROOT / "examples" / f"train_{framework}.py", nproc=2,
                          script_args=["--epochs", "2"], timeout_s=180.0,
                          env={"CANNIKIN_SLOWDOWN": "2,1"}).check()
    losses = losses_of(result)
    assert len(losses) == 2 and losses[1] < losses[0] < 2.31, result.stdout  # below ln 10
    split = chosen_splits(result)[-1]
    assert split[1] > split[0] > 0 and sum(split) == 64  # rank 1 is twice as fast
