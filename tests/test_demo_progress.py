"""The live display labels its loss as rank 0's local loss, with rank 0's batch size."""

from __future__ import annotations

import io

from rich.console import Console

from cannikin.demo.progress import DemoProgress


def test_live_loss_is_labelled_as_rank_zero_local_loss() -> None:
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=200, color_system=None)
    with DemoProgress(640, ["even", "cannikin"], console) as bar:
        bar.update([
            {"phase": "cannikin", "kind": "plan", "step": 1, "local_batches": [3, 3, 16, 42]},
            {"phase": "cannikin", "kind": "train", "step": 1, "rank0_loss": 1.25,
             "rank0_batch": 3, "samples": 64, "wall_s": 0.2},
            {"phase": "cannikin", "kind": "train", "step": 2, "rank0_loss": None,
             "rank0_batch": 0, "samples": 128, "wall_s": 0.4},
        ])
    text = stream.getvalue()
    assert "rank-0 loss 1.250 (b=3)" in text  # a step without rank-0 samples keeps the last
    assert "split 3/3/16/42" in text
    assert "128/640" in text
