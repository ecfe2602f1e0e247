"""Per-step metrics as JSON lines: written by rank 0, tailed by the parent process.

The sink is the small ``log(metrics, step)`` interface that ``HeteroDataParallel`` calls; the
reader turns a file that is still being written into whole records, so a live display can
poll it without ever seeing half a line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from cannikin.demo.files import json_safe


class JsonlSink:
    """Appends one JSON object per call, tagged with fixed fields (e.g. the run's phase)."""

    def __init__(self, path: str | Path, **tags: Any) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._tags = tags

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {**json_safe(metrics), **self._tags, "step": int(step)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
