"""The ``--plot`` figure: how Cannikin re-split the batch, how well it predicted the step
time, and what that did to throughput. matplotlib is imported only here, only when asked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cannikin.demo.report import PHASE_TITLES

THROUGHPUT_WINDOW = 10
"""Steps in the moving window of the throughput curve."""
COLORS = {"even": "tab:orange", "cannikin": "tab:blue"}


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


def write_plot(
    report: Mapping[str, Any], records: Sequence[Mapping[str, Any]], path: str | Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_split, ax_time, ax_rate) = plt.subplots(1, 3, figsize=(17, 6))
    speeds = report["speeds"]

    plans = _phase(records, "cannikin", "plan")
    steps = [r["step"] for r in plans]
    palette = plt.get_cmap("tab10")
    for rank, speed in enumerate(speeds):
        ax_split.plot(steps, [r["local_batches"][rank] for r in plans], lw=2,
                      color=palette((rank + 2) % 10), label=f"worker {rank} (speed {speed:g})")
    if report["adaptive_batch"]:
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

    for phase, title in PHASE_TITLES.items():
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

    for phase, title in PHASE_TITLES.items():
        times, rates = _moving_throughput(_phase(records, phase, "train"))
        ax_rate.plot(times, rates, lw=2, color=COLORS[phase],
                     label=f"{title}: {report[phase]['throughput']:.0f} samples/s overall")
    ax_rate.axhline(report["ideal_throughput"], color="black", ls="--", lw=1.5,
                    label=f"ideal (sum of speeds): {report['ideal_throughput']:.0f}")
    ax_rate.set(title=f"Throughput ({THROUGHPUT_WINDOW}-step moving window)",
                xlabel="seconds into each run", ylabel="samples / s")
    ax_rate.set_ylim(bottom=0)
    _legend_below(ax_rate)

    for ax in (ax_split, ax_time, ax_rate):
        ax.grid(alpha=0.3)
    fig.suptitle(f"cannikin demo: {len(speeds)} workers, speeds "
                 f"{', '.join(f'{s:g}' for s in speeds)}", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
