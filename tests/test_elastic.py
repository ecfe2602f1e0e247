"""Elastic restart (issue 7): a node is SIGKILLed mid-epoch, training resumes on 2 workers.

Three torchrun agents (one worker each, ``--nnodes=2:3``) train with HeteroDataParallel and
checkpoint every 4 steps. After step 14 the test kills agent 2 with its worker; the two
survivors fail at their next collective, torchrun restarts them in a world of 2, and they
resume from the step-12 checkpoint. The sample logs must show every index of every epoch
exactly once, counting the first run up to the checkpoint and the second run after it (steps
12-14 of the first run are replayed), and the second run must start at the checkpointed step.

A restart at the same world size reproducing the uninterrupted run is tests/test_resume.py.
"""

import json
import time
from pathlib import Path

import numpy as np

from dist_utils import WORKERS, start_agents

SAMPLES, BATCH, EPOCHS, EVERY, PAUSE = 240, 24, 3, 4, 14
STEPS_PER_EPOCH = -(-SAMPLES // BATCH)


def read_logs(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(out.glob("samples-*.jsonl"))
            for line in path.read_text().splitlines()]


def wait_for(condition, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def test_lost_node_resumes_from_checkpoint_with_exactly_once_samples(tmp_path: Path) -> None:
    args = [str(tmp_path), "--samples", str(SAMPLES), "--batch", str(BATCH),
            "--epochs", str(EPOCHS), "--checkpoint-every", str(EVERY),
            "--pause-after", str(PAUSE)]
    # 10 s of last call: on a loaded machine one agent can start seconds after the other two,
    # and the first world must hold all three
    job = start_agents(WORKERS / "elastic_worker.py", nnodes=3, min_nodes=2, max_restarts=2,
                       script_args=args, last_call_s=10)
    try:
        wait_for(lambda: len(list(tmp_path.glob("paused-r*"))) == 3, 120, "all 3 workers to pause")
        job.kill_agent(2)
        (tmp_path / "resume").touch()
    finally:
        results = job.wait(timeout_s=120)
    for index in (0, 1):
        results[index].check()
    assert not any(r.timed_out for r in results)

    logs = read_logs(tmp_path)
    # a run is one worker process; its start record says which world it trained in (the
    # restart count cannot: an agent that restarts a healthy worker keeps its count at 0)
    run_world = {r["run"]: r["world"] for r in logs if r["event"] == "start"}
    assert sorted(run_world.values()) == [2, 2, 3, 3, 3], run_world
    first = [r for r in logs if run_world[r["run"]] == 3 and r["event"] == "step"]
    second = [r for r in logs if run_world[r["run"]] == 2]
    assert {r["world"] for r in first} == {3} and {r["world"] for r in second} == {2}
    assert max(r["step"] for r in first) >= PAUSE  # the kill came mid-epoch, after step 14

    # the restarted run resumes at the newest checkpoint at or before the kill
    resumed = PAUSE + 1 - (PAUSE + 1) % EVERY
    starts = [r for r in second if r["event"] == "start"]
    assert len(starts) == 2 and {r["step"] for r in starts} == {resumed}
    assert {r["epoch"] for r in starts} == {resumed // STEPS_PER_EPOCH}
    steps_after = sorted({r["step"] for r in second if r["event"] == "step"})
    assert steps_after == list(range(resumed, EPOCHS * STEPS_PER_EPOCH))
    assert {r["step"] for r in second if r["event"] == "done"} == {EPOCHS * STEPS_PER_EPOCH}

    # exactly once per epoch: first run before the checkpoint + second run after it
    kept = [r for r in first if r["step"] < resumed] + [r for r in second if r["event"] == "step"]
    for epoch in range(EPOCHS):
        seen = np.concatenate([r["indices"] for r in kept if r["epoch"] == epoch])
        assert np.array_equal(np.sort(seen), np.arange(SAMPLES)), f"epoch {epoch}"
    replayed = {r["step"] for r in first if r["step"] >= resumed}
    assert replayed == set(range(resumed, PAUSE + 1))

    # training continued: the loss after the restart is below the loss at the start
    losses = {r["step"]: r["loss"] for r in kept if r["rank"] == 0}
    assert np.mean([losses[s] for s in range(3)]) > np.mean([losses[s] for s in steps_after[-3:]])

