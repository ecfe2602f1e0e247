"""Per-step metrics as JSON lines: written by rank 0 (:class:`cannikin.metrics.JsonlSink`),
tailed by the parent process.

The reader turns a file that is still being written into whole records, so a live display
can poll it without ever seeing half a line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class LineTail:
    """Reads the complete lines appended to a text file since the last call."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[str]:
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]


class JsonlTail:
    """The JSON records appended to a JSONL file since the last call."""

    def __init__(self, path: str | Path) -> None:
        self._lines = LineTail(path)

    def read_new(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self._lines.read_new() if line.strip()]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a finished JSONL file."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
