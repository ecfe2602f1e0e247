"""The all-reduce finisher thread computes with the launching thread's intra-op thread
count, not OpenMP's per-thread default (the machine's cores): a pool woken on that thread
spun on the worker's CPU for ~1.5 ms per step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cannikin.runtime.distributed import free_port
from dist_utils import SRC, TESTS, WORKERS


def test_the_finisher_computes_with_the_callers_thread_count() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=f"{SRC}{os.pathsep}{TESTS}", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               CANNIKIN_SLOWDOWN="")
    result = subprocess.run([sys.executable, str(WORKERS / "finisher_threads_worker.py")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    if lines["fresh"] == "none":
        pytest.skip("torch here loads no OpenMP runtime: no per-thread count to check")
    if int(lines["fresh"]) == 1:
        pytest.skip("a new thread starts with one OpenMP thread on this machine (one core, "
                    "or OMP_NUM_THREADS set by the environment): nothing to tell apart")
    counts = [int(n) for n in lines["finisher"].split()]
    assert counts, "no reduction went through the finisher thread (no step took norms)"
    assert set(counts) == {1}, f"the finisher computed with {counts} threads, the caller 1"
