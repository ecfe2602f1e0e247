"""PNG of a comparison: total batch and throughput over time, one line per policy."""

from __future__ import annotations

from pathlib import Path

from cannikin.sim.engine import Comparison

_STYLE = {
    "ddp": ("#7f7f7f", "--"), "adaptdl": ("#1f77b4", "-"), "lb-bsp": ("#9467bd", "-."),
    "cannikin": ("#d62728", "-"), "oracle": ("#2ca02c", ":"),
}


def plot_comparison(comparison: Comparison, path: str | Path) -> None:
    """Write the figure; matplotlib is imported here so the simulator never needs it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = comparison.results
    longest = max(r.elapsed_s for r in results.values())
    unit, scale = ("h", 3600.0) if longest > 3 * 3600 else ("min", 60.0)
    fig, (ax_b, ax_t) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, r in results.items():
        color, dash = _STYLE.get(name, (None, "-"))
        x = r.history_time_s / scale
        done = (f"{r.time_to_target_s / scale:.1f} {unit}" if r.time_to_target_s
                else "not reached")
        label = f"{name} (target at {done})"
        ax_b.step(x, r.history_total_batch, where="pre", color=color, linestyle=dash,
                  linewidth=2, label=label)
        ax_t.step(x, r.history_throughput, where="pre", color=color, linestyle=dash,
                  linewidth=2, label=name)
    ax_b.set_yscale("log")
    ax_b.set_ylabel("total batch size")
    ax_b.legend(loc="lower right", fontsize=9)
    ax_t.set_ylabel("throughput (samples/s)")
    ax_t.set_xlabel(f"simulated time ({unit})")
    ax_t.set_ylim(bottom=0)
    for ax in (ax_b, ax_t):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{comparison.workload.name} on {comparison.cluster.name or 'cluster'}: "
                 f"{comparison.cluster.summary()}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
