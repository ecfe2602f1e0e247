"""Run the whole demo from the parent process: launch the workers, show their progress live,
then read what they wrote and report it. The parent never imports torch."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from cannikin.demo import files
from cannikin.demo.config import DemoConfig
from cannikin.demo.digits import save_digits_split
from cannikin.demo.launch import run_local, torchrun_command, worker_env
from cannikin.demo.metrics import JsonlTail, LineTail, read_jsonl
from cannikin.demo.report import build_report
from cannikin.demo.teacher import save_teacher_split
from cannikin.runtime.quota import QuotaGroups

logger = logging.getLogger(__name__)

WORKER_MODULE = "cannikin.demo.worker"
SAVE_SPLIT = {"digits": save_digits_split, "teacher": save_teacher_split}
"""Each task's (path, seed) -> training-set size: writes the arrays the workers load."""


def run_demo(
    config: DemoConfig, *, out_dir: Path, timeout_s: float, console: Console,
    show_progress: bool = True, plot_path: Path | None = None,
) -> dict[str, Any]:
    """Train every phase (:attr:`DemoConfig.phases`) on a local cluster and return the
    report (see :mod:`report`); with ``plot_path``, also draw the figure there. With
    ``config.cpu_shares`` the workers run in CPU-quota groups made for this run
    (``QuotaUnavailable`` if cgroups are not writable) and removed after it; otherwise
    their speeds are emulated."""
    from cannikin.demo.progress import DemoProgress

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (files.METRICS, files.WORKER_LOG):
        (out_dir / stale).unlink(missing_ok=True)
    files.write_json(out_dir / files.CONFIG, config.to_json())
    train_size = SAVE_SPLIT[config.task](out_dir / files.SPLIT, config.seed)
    command = torchrun_command(
        config.workers, WORKER_MODULE,
        ["--config", str(out_dir / files.CONFIG), "--out", str(out_dir)],
    )
    metrics = JsonlTail(out_dir / files.METRICS)
    log_lines = LineTail(out_dir / files.WORKER_LOG)
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if config.cpu_shares is None:
            env = worker_env(config.slowdowns)
        else:
            groups = stack.enter_context(QuotaGroups.create(config.cpu_shares))
            env = worker_env(None, groups.env())
        bar = stack.enter_context(
            DemoProgress(config.sample_budget(train_size), [p for p, _ in config.phases],
                         console, show_progress))

        def poll() -> None:
            bar.update(metrics.read_new())
            if config.verbose:
                for line in log_lines.read_new():
                    bar.console.print(line, markup=False, highlight=False, soft_wrap=True)

        run_local(command, env=env, log_path=out_dir / files.WORKER_LOG, timeout_s=timeout_s,
                  on_poll=poll)
    wall_s = time.monotonic() - start
    phases = [p for p, _ in config.phases]
    results = {p: files.read_json(out_dir / files.result_name(p)) for p in phases}
    ranks = {
        p: [files.read_json(out_dir / files.rank_name(p, r)) for r in range(config.workers)]
        for p in phases
    }
    records = read_jsonl(out_dir / files.METRICS)
    report = build_report(config, results, records, ranks)
    report["wall_s"] = wall_s
    if plot_path is not None:
        from cannikin.demo.plot import write_plot

        write_plot(report, records, plot_path)
    return report
