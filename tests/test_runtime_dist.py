"""Multi-process runtime tests: ONE torchrun launch (3 gloo workers) runs every check.

Start-up costs ~8 s on this machine, so the checks share a launch (module fixture)
and each test asserts on the figures its check reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "runtime_worker.py"
CHECKS = ["grad_mlp", "grad_plain_ddp", "grad_unused", "grad_batchnorm"]
LAUNCH_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("runtime") / "figures.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=3", str(WORKER), str(out), *CHECKS]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("CANNIKIN_SLOWDOWN", None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:  # a hung worker fails, never hangs CI
        pytest.fail(f"runtime workers did not finish within {LAUNCH_TIMEOUT_S} s: {exc}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.parametrize("check", ["grad_mlp", "grad_unused", "grad_batchnorm"])
def test_weighted_gradient_equals_single_process(figures: dict[str, Any], check: str) -> None:
    # splits (3, 11, 50), (50, 3, 11), (0, 30, 34) with DDP's bucket rebuild in between
    assert figures[check]["rel_err"] < 1e-5


def test_plain_ddp_average_is_wrong_for_uneven_batches(figures: dict[str, Any]) -> None:
    assert figures["grad_plain_ddp"]["rel_err"] > 1e-2
