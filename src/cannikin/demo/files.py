"""Names of the files the demo's workers leave in the output directory, and how they are
written (atomically, so the parent never reads half a file)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cannikin.metrics import json_safe

CONFIG = "config.json"
METRICS = "metrics.jsonl"
WORKER_LOG = "workers.log"
SPLIT = "split.npz"
"""The task's training and held-out arrays, saved by the parent for the workers."""


def result_name(phase: str) -> str:
    return f"result_{phase}.json"


def rank_name(phase: str, rank: int) -> str:
    return f"rank{rank}_{phase}.json"


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    text = json.dumps(json_safe(data), indent=2, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
