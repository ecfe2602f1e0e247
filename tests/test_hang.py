"""A hung worker under HeteroDataParallel ends the job at the collective timeout with an
error naming the rank (tests/test_distributed.py covers a bare all-reduce)."""

import re

import pytest

from cannikin.runtime.parallel import NORM_STRIDE
from dist_utils import WORKERS, run_torchrun

# gloo words an expired wait either way, depending on which side of the pair notices first
GLOO_TIMEOUT = re.compile(r"Timed out|Application timeout caused pair closure")


@pytest.mark.parametrize(("hang_step", "idle"), [(3, False), (NORM_STRIDE, False), (3, True)],
                         ids=["plain-step", "norm-step", "idle-route"])
def test_hung_peer_fails_training_with_timeout_naming_rank(hang_step: int, idle: bool) -> None:
    """Both ways a step's all-reduces complete: a step without gradient norms waits for
    them in the last bucket's hook, a step with norms on the finisher thread; and a hung
    rank with no samples, which its peer waits for in the idle route's broadcast (a group
    of its own, made after start-up: it must keep the timeout too)."""
    result = run_torchrun(WORKERS / "hang_worker.py", nproc=2,
                          script_args=["--timeout", "3", "--hang-step", str(hang_step),
                                       *(["--idle"] if idle else [])],
                          timeout_s=90, env={"CANNIKIN_SLOWDOWN": ""})
    assert not result.timed_out, "the job hung instead of failing at the collective timeout"
    assert result.returncode != 0
    assert "rank 1 stops responding" in result.stdout
    output = result.stdout + result.stderr
    assert "rank 0 of 2: gradient all-reduce failed (a peer worker may be hung" in output
    assert "Unable to cast" not in output  # raised as an error, not read as a bucket
    assert GLOO_TIMEOUT.search(output), "the failure was not the process group's timeout"


@pytest.mark.parametrize(("skip", "samples", "went_on_to"),
                         [("continue", 200, "the next step"),
                          ("step", 200, "its optimizer step"),
                          ("continue", 20, "the end of its epoch")])
def test_an_idle_rank_that_skips_its_backward_fails_naming_why(skip: str, samples: int,
                                                               went_on_to: str) -> None:
    """A script that skips the backward on a non-finite local loss skips it on a rank
    planned 0 samples alone (its mean loss is NaN): that rank raises, at its next step, at
    the optimizer step it still takes, or at the end of its epoch where that step was the
    last (20 samples: one step), naming the cause and the ways out, instead of its peer
    waiting for it in the all-reduce."""
    result = run_torchrun(WORKERS / "hang_worker.py", nproc=2,
                          script_args=["--timeout", "60", "--skip-nonfinite", skip,
                                       "--samples", str(samples)],
                          timeout_s=50, env={"CANNIKIN_SLOWDOWN": ""})
    assert not result.timed_out, "the job waited instead of failing at the skipped backward"
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert (f"rank 1 had 0 samples in step 0 (split [20, 0]) and went on to {went_on_to} "
            f"without a backward") in output
    assert "allow_idle=False" in output
