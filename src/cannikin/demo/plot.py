"""The ``--plot`` figure: how Cannikin re-split the batch, how well it predicted the step
time, and what that did to throughput (with a target: accuracy and batch over time too).
matplotlib is imported only here, only when asked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cannikin.demo.report import PHASE_TITLES

THROUGHPUT_WINDOW = 10
"""Steps in the moving window of the throughput curve."""
COLORS = {"even": "tab:orange", "adaptdl": "tab:green", "cannikin": "tab:blue"}


def _phase(records: Sequence[Mapping[str, Any]], phase: str, kind: str) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("phase") == phase and r.get("kind") == kind]


def _moving_throughput(train: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """(wall seconds, samples/s over the last THROUGHPUT_WINDOW steps) of one phase."""
    times, rates = [], []
    for i in range(THROUGHPUT_WINDOW, len(train)):
        old, new = train[i - THROUGHPUT_WINDOW], train[i]
        if new["wall_s"] > old["wall_s"]:
            times.append(new["wall_s"])
            rates.append((new["samples"] - old["samples"]) / (new["wall_s"] - old["wall_s"]))
    return times, rates


def _epoch_starts(plans: Sequence[Mapping[str, Any]]) -> list[int]:
    """Steps that begin a new epoch (after the previous epoch's smaller remainder batch)."""
    return [b["step"] for a, b in zip(plans, plans[1:], strict=False)
            if b.get("epoch") != a.get("epoch")]


def _legend_below(ax: Any) -> None:
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
              frameon=False)


def _plot_time_to_target(ax_accuracy: Any, ax_batch: Any, report: Mapping[str, Any],
                         records: Sequence[Mapping[str, Any]], titles: Mapping[str, str]) -> None:
    """Held-out accuracy and the total batch against training time, one line per run."""
    for phase, title in titles.items():
        evals = _phase(records, phase, "eval")
        seconds = report[phase]["time_to_target_s"]
        reached = "not reached" if seconds is None else f"{seconds:.1f} s"
        ax_accuracy.plot([r["train_s"] for r in evals], [100 * r["accuracy"] for r in evals],
                         "-o", ms=3, lw=2, color=COLORS[phase], label=f"{title}: {reached}")
        train = _phase(records, phase, "train")
        ax_batch.step([r["wall_s"] for r in train], [r["total_batch"] for r in train],
                      where="post", lw=2, color=COLORS[phase], label=title)
    ax_accuracy.axhline(100 * report["target"], color="black", ls="--", lw=1.5,
                        label=f"target {100 * report['target']:g}%")
    ax_accuracy.set(title="Held-out accuracy", xlabel="training seconds (evaluations excluded)",
                    ylabel="%")
    ax_batch.set(title="Total batch", xlabel="training seconds", ylabel="samples per step")
    ax_batch.set_ylim(bottom=0)
    _legend_below(ax_accuracy)
    _legend_below(ax_batch)


def write_plot(
    report: Mapping[str, Any], records: Sequence[Mapping[str, Any]], path: str | Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = report.get("target")
    fig, axes = plt.subplots(1, 3 if target is None else 5,
                             figsize=(17, 6) if target is None else (28, 6))
    ax_split, ax_time, ax_rate = axes[:3]
    speeds = report["speeds"]
    titles = {p: PHASE_TITLES[p] for p in report["phases"]}

    plans = _phase(records, "cannikin", "plan")
    steps = [r["step"] for r in plans]
    palette = plt.get_cmap("tab10")
    for rank, speed in enumerate(speeds):
        ax_split.plot(steps, [r["local_batches"][rank] for r in plans], lw=2,
                      color=palette((rank + 2) % 10), label=f"worker {rank} (speed {speed:g})")
    if report["adaptive_batch"] or target is not None:
        ax_split.plot(steps, [r["total_batch"] for r in plans], color="black", ls=":", lw=1.5,
                      label="total batch (chosen by goodput)")
    even_plans = _phase(records, "even", "plan")
    ax_split.plot([r["step"] for r in even_plans],
                  [sum(r["local_batches"]) / len(speeds) for r in even_plans],
                  color="gray", ls="--", lw=1.5, label="every worker, even split (DDP)")
    ax_split.set(title="Cannikin: local batch size per worker", xlabel="step",
                 ylabel="local batch (samples)")
    ax_split.set_ylim(bottom=0)
    for ax in (ax_split, ax_time):
        for i, step in enumerate(_epoch_starts(plans)):
            ax.axvline(step, color="black", lw=0.6, alpha=0.3,
                       label="new epoch (after a smaller remainder batch)" if i == 0 else None)
    _legend_below(ax_split)

    for phase, title in titles.items():
        rows = _phase(records, phase, "plan")
        color = COLORS[phase]
        ax_time.plot([r["step"] for r in rows], [1000 * (r["step_time_s"] or float("nan"))
                                                 for r in rows],
                     ".", ms=4, alpha=0.5, color=color, label=f"{title}: measured")
        ax_time.plot([r["step"] for r in rows],
                     [1000 * (r["predicted_step_time_s"] or float("nan")) for r in rows],
                     "-", lw=2, color=color, label=f"{title}: predicted")
    ax_time.set(title="Step time: measured vs predicted", xlabel="step", ylabel="ms")
    ax_time.set_ylim(bottom=0)
    _legend_below(ax_time)

    for phase, title in titles.items():
        times, rates = _moving_throughput(_phase(records, phase, "train"))
        ax_rate.plot(times, rates, lw=2, color=COLORS[phase],
                     label=f"{title}: {report[phase]['throughput']:.0f} samples/s overall")
    ax_rate.axhline(report["ideal_throughput"], color="black", ls="--", lw=1.5,
                    label=f"ideal (sum of speeds): {report['ideal_throughput']:.0f}")
    ax_rate.set(title=f"Throughput ({THROUGHPUT_WINDOW}-step moving window)",
                xlabel="seconds into each run", ylabel="samples / s")
    ax_rate.set_ylim(bottom=0)
    _legend_below(ax_rate)

    if target is not None:
        _plot_time_to_target(axes[3], axes[4], report, records, titles)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"cannikin demo: {len(speeds)} workers, speeds "
                 f"{', '.join(f'{s:g}' for s in speeds)}", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
