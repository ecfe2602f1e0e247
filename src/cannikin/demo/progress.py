"""The live terminal display: one progress bar per phase, fed by the metrics the workers
append (step rate, throughput, current split, rank 0's local loss), instead of a scroll of
log lines. The loss shown is the mean over rank 0's own samples of the step (its share of
the split), labelled so: it is noisy, and noisier under Cannikin, where the slow rank 0 gets
few samples, so it is no measure of the training loss (the report evaluates that at the end)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cannikin.demo.report import PHASE_TITLES

RATE_WINDOW = 10
"""Steps over which the displayed step rate is measured."""


class DemoProgress:
    """Progress in samples (the budget the phases share), updated from metric records."""

    def __init__(self, budget: int, phases: Sequence[str], console: Console,
                 enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("{task.description:<17}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TextColumn("samples"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("[cyan]{task.fields[split]}[/]"),
            TextColumn("{task.fields[loss]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not (enabled and console.is_terminal),
        )
        self._startup = self._progress.add_task(
            "starting workers", total=None, rate="", split="", loss=""
        )
        self._tasks = {
            phase: self._progress.add_task(
                title, total=budget, start=False, rate="", split="", loss=""
            )
            for phase, title in ((p, PHASE_TITLES[p]) for p in phases)
        }
        self._recent: dict[str, deque[tuple[float, int]]] = {
            phase: deque(maxlen=RATE_WINDOW + 1) for phase in phases
        }

    @property
    def console(self) -> Console:
        return self._progress.console

    def __enter__(self) -> DemoProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            phase = record.get("phase")
            if phase not in self._tasks:
                continue
            task = self._tasks[phase]
            self._progress.update(self._startup, visible=False)
            self._progress.start_task(task)
            if record.get("kind") == "plan" and record.get("local_batches") is not None:
                split = "/".join(str(b) for b in record["local_batches"])
                self._progress.update(task, split=f"split {split}")
            elif record.get("kind") == "train":
                recent = self._recent[phase]
                recent.append((record["wall_s"], record["samples"]))
                loss = record.get("rank0_loss")  # None on a step where rank 0 had no samples
                fields: dict[str, Any] = {} if loss is None else {
                    "loss": f"rank-0 loss {loss:.3f} (b={record['rank0_batch']})"
                }
                if len(recent) > 1 and recent[-1][0] > recent[0][0]:
                    dt = recent[-1][0] - recent[0][0]
                    steps_s = (len(recent) - 1) / dt
                    samples_s = (recent[-1][1] - recent[0][1]) / dt
                    fields["rate"] = f"{steps_s:5.1f} steps/s {samples_s:5.0f} samples/s"
                self._progress.update(task, completed=record["samples"], **fields)
