"""The planning modules must import where torch is not installed (DESIGN.md §8)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PURE = ["cannikin", "cannikin.metrics", "cannikin.perf", "cannikin.optperf",
        "cannikin.goodput", "cannikin.gns", "cannikin.losscheck", "cannikin.scaling",
        "cannikin.sim",
        "cannikin.cli.simulate", "cannikin.cli.plan",
        # the runtime package is lazy: its torch-free parts import without torch
        "cannikin.runtime", "cannikin.runtime.sampler", "cannikin.runtime.planner",
        "cannikin.runtime.launch_args", "cannikin.runtime.quota", "cannikin.cli.launch"]

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked for this test")
        return None
sys.meta_path.insert(0, _NoTorch())
import importlib
importlib.import_module({module!r})
assert "torch" not in sys.modules
"""


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_without_torch(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH.format(module=module)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert result.returncode == 0, result.stderr
