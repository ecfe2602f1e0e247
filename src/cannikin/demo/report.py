"""Turn what the workers wrote into the demo's report: a dict (the ``--json`` file) and a rich
table. Pure Python; every figure is computed here from the raw files, in one place.

Definitions
-----------
throughput
    samples trained on / wall time of the training loop (rank 0, between barriers; the
    evaluation afterwards is not counted). It includes the first steps, where Cannikin still
    uses the even split while it measures the workers.
mean_step_time_s
    mean of the per-step times that ``HeteroDataParallel`` measured.
predicted_step_time_s / measured_step_time_s
    means over the second half of the steps of the model's predicted step time and of the
    measured one (the first half includes the warm-up before the model has data).
prediction_error_median
    median over re-planning windows of |mean predicted - mean measured| / mean measured step
    time of the window (``PredictionTracker.median_window_error``).
ideal_throughput
    sum of the worker speeds x the baseline's throughput per unit of speed. In the even
    baseline the slowest worker (speed s_min) sets the pace, so one unit of speed is worth
    throughput_even / (n * s_min) samples/s; the ideal is what the cluster would train if
    every worker were as busy as that one: throughput_even * sum(s) / (n * s_min). For a fixed
    total batch it is the limit an optimal split approaches (communication and the fixed
    per-step cost do not shrink with the split, so it is not reached exactly). Under CPU
    quotas the speeds are nominal (the shares' ratios; a small share runs slower than its
    share), so the ideal is a guide only.
time_to_target_s
    with a target accuracy: the run's training time (evaluations excluded) when the
    held-out accuracy, evaluated every ``eval_every`` samples, first reached the target;
    None if it never did within the budget. ``time_to_target_vs`` divides Cannikin's by
    each other run's.
mean_batch / final_batch
    samples per step over the run, and the total batch planned at its end.
samples_seen_per_epoch
    distinct training samples used in each epoch of the Cannikin run, over all workers; with
    exactly-once sampling it equals the training set size for every full epoch (the last
    epoch may be partial when ``--steps`` ends mid-epoch).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from cannikin.demo.config import DemoConfig

PHASE_TITLES = {"even": "DDP (even split)", "adaptdl": "AdaptDL-like", "cannikin": "Cannikin"}
"""Every phase a demo can run (:attr:`DemoConfig.phases` says which, in order)."""


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def _mean(values: Sequence[Any]) -> float | None:
    finite = _finite(values)
    return statistics.fmean(finite) if finite else None


def epoch_coverage(per_rank: Sequence[Sequence[Sequence[int]]]) -> tuple[list[int], list[int]]:
    """Distinct samples and repeated uses per epoch, from every rank's per-epoch indices."""
    epochs = max((len(r) for r in per_rank), default=0)
    distinct: list[int] = []
    repeats: list[int] = []
    for e in range(epochs):
        used = [i for rank in per_rank if e < len(rank) for i in rank[e]]
        distinct.append(len(set(used)))
        repeats.append(len(used) - len(set(used)))
    return distinct, repeats


def phase_summary(
    result: Mapping[str, Any],
    plan_records: Sequence[Mapping[str, Any]],
    ranks: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """One phase's figures (see the module docstring for their definitions), from its result,
    its per-step records and every rank's file (slowdown, threads, indices per epoch)."""
    tail = plan_records[len(plan_records) // 2:]
    paired = [
        (r["predicted_step_time_s"], r["step_time_s"]) for r in tail
        if len(_finite([r.get("predicted_step_time_s"), r.get("step_time_s")])) == 2
    ]
    distinct, repeats = epoch_coverage([rank["epochs"] for rank in ranks])
    return {
        "throughput": result["samples"] / result["wall_s"],
        "mean_step_time_s": _mean([r.get("step_time_s") for r in plan_records]),
        "final_loss": result["final_loss"],
        "accuracy": result["accuracy"],
        "test_loss": result["test_loss"],
        "local_batches": list(result["local_batches"]),
        "prediction_error_median": result["prediction_error_median"],
        "prediction_error_step_median": result["prediction_error_step_median"],
        "mean_batch": result.get("mean_batch"),
        "final_batch": result.get("final_batch"),
        "time_to_target_s": result.get("time_to_target_s"),
        "steps_to_target": result.get("steps_to_target"),
        "samples_to_target": result.get("samples_to_target"),
        "predicted_step_time_s": _mean([p for p, _ in paired]),
        "measured_step_time_s": _mean([m for _, m in paired]),
        "steps": result["steps"],
        "samples": result["samples"],
        "wall_s": result["wall_s"],
        "samples_seen_per_epoch": distinct,
        "repeated_samples_per_epoch": repeats,
        "slowdowns": [rank["slowdown"] for rank in ranks],
        "cpu_shares": [rank.get("cpu_share") for rank in ranks],
        "num_threads": [rank["num_threads"] for rank in ranks],
    }


def build_report(
    config: DemoConfig,
    results: Mapping[str, Mapping[str, Any]],
    records: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, Any]:
    """The ``--json`` document: per phase figures, the ideal, and exactly-once coverage."""
    phases = {
        phase: phase_summary(
            results[phase],
            [r for r in records if r.get("phase") == phase and r.get("kind") == "plan"],
            ranks[phase],
        )
        for phase, _ in config.phases
    }
    speeds = config.speeds
    even = phases["even"]["throughput"]
    cannikin_time = phases["cannikin"]["time_to_target_s"]
    versus = {
        phase: None if cannikin_time is None or not figures["time_to_target_s"]
        else cannikin_time / figures["time_to_target_s"]
        for phase, figures in phases.items() if phase != "cannikin"
    }
    return {
        "phases": list(phases),
        "task": config.task,
        "lr_decay": config.lr_decay,
        "target": config.target,
        "time_to_target_vs": versus if config.target is not None else None,
        "workers": config.workers,
        "speeds": list(speeds),
        "heterogeneity": config.heterogeneity,
        "cpu_shares": None if config.cpu_shares is None else list(config.cpu_shares),
        "batch_size": config.batch_size,
        "adaptive_batch": config.adaptive_batch,
        "train_size": results["even"]["train_size"],
        "test_size": results["even"]["test_size"],
        **phases,
        "ideal_throughput": even * sum(speeds) / (len(speeds) * min(speeds)),
        "speedup": phases["cannikin"]["throughput"] / even,
        "samples_seen_per_epoch": phases["cannikin"]["samples_seen_per_epoch"],
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None or not math.isfinite(fraction) else f"{100 * fraction:.1f}%"


def table_rows(report: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """(figure, one value per phase in ``report["phases"]``, note) rows of the printed
    table (two phases fit 80 columns)."""
    phases = [report[p] for p in report["phases"]]
    n = report["train_size"]
    even_rate = report["even"]["throughput"]

    def row(figure: str, cell: Any, note: str = "") -> tuple[str, ...]:
        return (figure, *(cell(phase) for phase in phases), note)

    def rate(phase: Mapping[str, Any]) -> str:
        ratio = phase["throughput"] / even_rate
        return f"{phase['throughput']:.0f}" + ("" if phase is report["even"] else
                                               f" ({ratio:.2f}x)")

    def complete(phase: Mapping[str, Any]) -> str:
        seen = phase["samples_seen_per_epoch"]
        return f"{sum(1 for s in seen if s == n)}/{len(seen)}"

    def to_target(phase: Mapping[str, Any]) -> str:
        seconds = phase["time_to_target_s"]
        return "not reached" if seconds is None else (
            f"{seconds:.1f} s, {phase['steps_to_target']} steps")

    rows = [
        row("throughput, samples/s", rate, f"ideal {report['ideal_throughput']:.0f}"),
        row("mean step time, ms", lambda p: _ms(p["mean_step_time_s"])),
        row("predicted/measured ms", lambda p: f"{_ms(p['predicted_step_time_s'])} / "
                                               f"{_ms(p['measured_step_time_s'])}", "2nd half"),
        row("prediction error", lambda p: _pct(p["prediction_error_median"]), "per window"),
        row("local batches", lambda p: " ".join(map(str, p["local_batches"])),
            "speeds " + " ".join(f"{s:g}" for s in report["speeds"])),
        row("steps / samples", lambda p: f"{p['steps']} / {p['samples']}"),
        row("final training loss", lambda p: f"{p['final_loss']:.3f}"),
        row("held-out accuracy", lambda p: _pct(p["accuracy"]), f"{report['test_size']} "
            + ("images" if report["task"] == "digits" else f"{report['task']} samples")),
        row("epochs, all samples", complete, f"{n} per epoch"),
        row("samples used twice", lambda p: str(sum(p["repeated_samples_per_epoch"])),
            "exactly once"),
    ]
    if report.get("target") is None:
        return rows
    versus = report["time_to_target_vs"]
    note = ", ".join(f"{ratio:.2f}x {PHASE_TITLES[p]}" for p, ratio in versus.items()
                     if ratio is not None)
    return [
        row(f"time to {_pct(report['target'])}", to_target,
            f"Cannikin: {note}" if note else "training time"),
        row("mean / final batch", lambda p: f"{p['mean_batch']:.0f} / {p['final_batch']}"
            if p["mean_batch"] is not None else "-"),
        *rows,
    ]


def render_table(report: Mapping[str, Any]) -> Any:
    """The report as a ``rich.table.Table``."""
    from rich.table import Table

    speeds = ",".join(f"{s:g}" for s in report["speeds"])
    mode = ("adaptive" if report["adaptive_batch"] or report.get("target") is not None
            else "fixed")
    shares = report.get("cpu_shares")
    kind = "emulated" if shares is None else "CPU quotas " + ",".join(f"{s:g}" for s in shares)
    table = Table(
        title=f"cannikin demo: {report['workers']} workers, speeds {speeds} ({kind}), "
              f"batch {report['batch_size']} ({mode})",
    )
    table.add_column("")
    for phase in report["phases"]:
        table.add_column(PHASE_TITLES[phase], justify="right",
                         style="bold" if phase == "cannikin" else None)
    table.add_column("", style="dim")
    for row in table_rows(report):
        table.add_row(*row)
    return table
