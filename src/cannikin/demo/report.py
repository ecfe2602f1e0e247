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

PHASE_TITLES = {"even": "DDP (even split)", "cannikin": "Cannikin"}


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
        for phase in PHASE_TITLES
    }
    speeds = config.speeds
    even = phases["even"]["throughput"]
    return {
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


def table_rows(report: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, even, Cannikin, note) rows of the printed table (fits 80 columns)."""
    even, can = report["even"], report["cannikin"]
    n = report["train_size"]

    def step_times(phase: Mapping[str, Any]) -> str:
        return f"{_ms(phase['predicted_step_time_s'])} / {_ms(phase['measured_step_time_s'])}"

    def complete(phase: Mapping[str, Any]) -> str:
        seen = phase["samples_seen_per_epoch"]
        return f"{sum(1 for s in seen if s == n)}/{len(seen)}"

    def repeated(phase: Mapping[str, Any]) -> str:
        return str(sum(phase["repeated_samples_per_epoch"]))

    return [
        ("throughput, samples/s", f"{even['throughput']:.0f}",
         f"{can['throughput']:.0f} ({report['speedup']:.2f}x)",
         f"ideal {report['ideal_throughput']:.0f}"),
        ("mean step time, ms", _ms(even["mean_step_time_s"]), _ms(can["mean_step_time_s"]), ""),
        ("predicted/measured ms", step_times(even), step_times(can), "2nd half"),
        ("prediction error", _pct(even["prediction_error_median"]),
         _pct(can["prediction_error_median"]), "per window"),
        ("local batches", " ".join(map(str, even["local_batches"])),
         " ".join(map(str, can["local_batches"])),
         "speeds " + " ".join(f"{s:g}" for s in report["speeds"])),
        ("steps / samples", f"{even['steps']} / {even['samples']}",
         f"{can['steps']} / {can['samples']}", ""),
        ("final training loss", f"{even['final_loss']:.3f}", f"{can['final_loss']:.3f}", ""),
        ("held-out accuracy", _pct(even["accuracy"]), _pct(can["accuracy"]),
         f"{report['test_size']} images"),
        ("epochs, all samples", complete(even), complete(can), f"{n} per epoch"),
        ("samples used twice", repeated(even), repeated(can), "exactly once"),
    ]


def render_table(report: Mapping[str, Any]) -> Any:
    """The report as a ``rich.table.Table``."""
    from rich.table import Table

    speeds = ",".join(f"{s:g}" for s in report["speeds"])
    mode = "adaptive" if report["adaptive_batch"] else "fixed"
    shares = report.get("cpu_shares")
    kind = "emulated" if shares is None else "CPU quotas " + ",".join(f"{s:g}" for s in shares)
    table = Table(
        title=f"cannikin demo: {report['workers']} workers, speeds {speeds} ({kind}), "
              f"batch {report['batch_size']} ({mode})",
    )
    table.add_column("")
    table.add_column(PHASE_TITLES["even"], justify="right")
    table.add_column(PHASE_TITLES["cannikin"], justify="right", style="bold")
    table.add_column("", style="dim")
    for row in table_rows(report):
        table.add_row(*row)
    return table
