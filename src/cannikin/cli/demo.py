"""``cannikin demo``: train a small CNN (or, ``--task teacher``, softmax regression on noisy
synthetic labels) on a local heterogeneous cluster, first with the even split of plain DDP
and then with Cannikin, and compare them side by side (with ``--target``, time to a
held-out accuracy, with an AdaptDL-like run between them). The workers' speeds
are emulated (sleep-padding, the default) or real (``--heterogeneity quota``: a CPU quota per
worker, proportional to its speed).

Bad input (an unknown option, speeds that do not match the worker count, a speed that is not
positive, more workers than the machine holds, an output file in a missing or read-only
directory, or a directory given as a file) is reported in one line with exit status 2 before
any worker starts; so is ``--heterogeneity quota`` where CPU quotas cannot be set (the line
names the fallback, ``--heterogeneity emulate``: a run asked for real heterogeneity is never
silently emulated). A failed or timed-out run exits with status 1 and names the log to read.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from cannikin.demo.config import LR_SCHEDULES, TASKS
from cannikin.runtime.quota import (
    DEFAULT_PERIOD_US,
    MIN_QUOTA_US,
    QuotaUnavailable,
    find_hierarchy,
    shares_for_speeds,
    usable_cores,
    validate_shares,
)

DEFAULT_EPOCHS = 4
DEFAULT_TIMEOUT_S = 600.0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not valid: it must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not valid: it must be a positive number")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(
            f"{text} is not valid: give a fraction strictly between 0 and 1, e.g. 0.9")
    return value


def _speeds(text: str) -> tuple[float, ...]:
    """Comma-separated worker speeds, e.g. ``1,2,4``."""
    parts = [p.strip() for p in text.split(",")]
    speeds = []
    for part in parts:
        try:
            speed = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} in {text!r} is not a number: give comma-separated positive speeds "
                "such as 1,2,4"
            ) from None
        if not (math.isfinite(speed) and speed > 0):
            raise argparse.ArgumentTypeError(
                f"speed {part} in {text!r} is not valid: every speed must be a positive number"
            )
        speeds.append(speed)
    return tuple(speeds)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="the main job: a local heterogeneous cluster (emulated speeds, or real "
                     "CPU quotas), trained for real",
        description=" ".join(__doc__.split("\n\n")[0].split()),
    )
    parser.add_argument("--workers", type=_positive_int,
                        help="number of workers (default 4, or one per --speeds value)")
    parser.add_argument("--speeds", type=_speeds,
                        help="comma-separated relative worker speeds, e.g. 1,2,4 (default for 4 "
                             "workers: 1,1,2,4; for n workers 2**floor(2i/(n-1)))")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=_positive_int,
                        help=f"passes over the training split (default {DEFAULT_EPOCHS})")
    length.add_argument("--steps", type=_positive_int,
                        help="train for this many baseline steps (steps x batch-size samples)")
    parser.add_argument("--heterogeneity", choices=("emulate", "quota"), default="emulate",
                        help="emulate: pad each worker's compute to its speed with sleeps "
                             "(default); quota: real speeds, a CPU quota per worker "
                             "(cgroups, root) proportional to its speed, the fastest a whole "
                             "core, scaled down until they fit the machine's cores")
    parser.add_argument("--batch-size", type=_positive_int, default=64,
                        help="initial total batch size B0 (default 64)")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--adaptive-batch", dest="adaptive_batch", action="store_true",
                       help="let Cannikin also choose the total batch size by goodput")
    batch.add_argument("--fixed-batch", dest="adaptive_batch", action="store_false",
                       help="keep the total batch at --batch-size; only the split adapts "
                            "(default)")
    parser.set_defaults(adaptive_batch=False)
    parser.add_argument("--target", type=_fraction, metavar="ACCURACY",
                        help="time to accuracy: three runs (DDP; AdaptDL-like, the even split "
                             "with a goodput-chosen batch; Cannikin with a goodput-chosen "
                             "batch), each until the held-out accuracy reaches this fraction, "
                             "e.g. 0.9, or the --epochs/--steps budget runs out")
    parser.add_argument("--task", choices=TASKS, default="digits",
                        help="digits: a small CNN on scikit-learn's handwritten digits "
                             "(default); teacher: softmax regression on a random linear "
                             "teacher's noisy labels (64 Gaussian features, 8192 training "
                             "samples, best held-out accuracy ~86%%), whose gradient noise "
                             "scale grows as it trains, so the goodput batch grows")
    parser.add_argument("--lr-decay", choices=LR_SCHEDULES,
                        help="divide the learning rate by 10 half way through the budget, "
                             "counted in optimizer steps of B0 (steps: a plain LambdaLR) or "
                             "in AdaScale's progress (progress); default: a constant rate")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG figure")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="keep the workers' logs and metrics here (default: a temporary "
                             "directory, removed after a successful run)")
    parser.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S,
                        metavar="SECONDS", help=f"hard limit on the run (default "
                                                f"{DEFAULT_TIMEOUT_S:g} s)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no live progress bars")
    parser.add_argument("--verbose", action="store_true", help="show the workers' logs")
    parser.set_defaults(func=_run, parser=parser)


def _unwritable_file(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (checked before a run of minutes), or None."""
    parent = path.resolve().parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if path.is_dir():
        return "is a directory, expected a file path"
    if not os.access(path if path.exists() else parent, os.W_OK):
        return f"{'file' if path.exists() else f'directory {parent}'} is not writable"
    return None


def _config(args: argparse.Namespace) -> Any:
    """The validated DemoConfig, or a usage error (exit 2) naming what is wrong."""
    from cannikin.demo.config import DEFAULT_WORKERS, DemoConfig, default_speeds

    parser: argparse.ArgumentParser = args.parser
    if args.speeds is not None and args.workers is not None and len(args.speeds) != args.workers:
        parser.error(
            f"--speeds has {len(args.speeds)} values ({','.join(f'{s:g}' for s in args.speeds)}) "
            f"but --workers is {args.workers}: give one speed per worker"
        )
    speeds = args.speeds or default_speeds(args.workers or DEFAULT_WORKERS)
    for option in ("json", "plot"):
        path: Path | None = getattr(args, option)
        problem = None if path is None else _unwritable_file(path)
        if problem is not None:
            parser.error(f"--{option} {path}: {problem}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    epochs = args.epochs if args.epochs is not None or args.steps is not None else DEFAULT_EPOCHS
    try:
        return DemoConfig(
            speeds=speeds, epochs=epochs, steps=args.steps, batch_size=args.batch_size,
            adaptive_batch=args.adaptive_batch, target=args.target, task=args.task,
            lr_decay=args.lr_decay, seed=args.seed, verbose=args.verbose,
            cpu_shares=_cpu_shares(speeds) if args.heterogeneity == "quota" else None,
        )
    except (ValueError, QuotaUnavailable) as err:
        parser.error(f"--heterogeneity quota: {err}" if isinstance(err, QuotaUnavailable)
                     else str(err))


def _cpu_shares(speeds: tuple[float, ...]) -> tuple[float, ...]:
    """Quota shares for ``speeds`` that fit this machine (ValueError names a share below the
    kernel's minimum; QuotaUnavailable when there is no writable cpu controller)."""
    hierarchy = find_hierarchy()
    cores = usable_cores(hierarchy)
    shares = shares_for_speeds(speeds, cores)
    try:
        return validate_shares(shares, cores)
    except ValueError as err:
        ratio = DEFAULT_PERIOD_US / MIN_QUOTA_US
        raise ValueError(f"--heterogeneity quota: speeds {','.join(f'{s:g}' for s in speeds)} "
                         f"give CPU shares {','.join(f'{s:g}' for s in shares)}: {err}; keep "
                         f"the fastest within {ratio:g}x the slowest") from None


DEMO_NEEDS = {"torch": "torch", "rich": "rich", "sklearn": "scikit-learn"}
"""Module -> the package that provides it: what ``cannikin demo`` imports beyond the core."""


def _missing_packages() -> list[str]:
    """The packages of :data:`DEMO_NEEDS` that are not installed."""
    return [package for module, package in DEMO_NEEDS.items()
            if importlib.util.find_spec(module) is None]


def _run(args: argparse.Namespace) -> int:
    missing = _missing_packages()
    if missing:
        args.parser.error(f"the demo needs {', '.join(missing)}: pip install "
                          f"'cannikin[demo,torch]' (or `make demo`, which installs everything)")
    config = _config(args)
    from rich.console import Console

    from cannikin.demo import files
    from cannikin.demo.launch import LaunchError, failure_excerpt
    from cannikin.demo.report import render_table
    from cannikin.demo.run import run_demo
    from cannikin.log import setup_logging

    setup_logging(0, args.verbose)
    err = Console(stderr=True)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="cannikin-demo-"))
    try:
        report = run_demo(config, out_dir=out_dir, timeout_s=args.timeout, console=err,
                          show_progress=args.progress, plot_path=args.plot)
    except QuotaUnavailable as error:  # the groups could not be made after all
        print(f"cannikin demo: error: --heterogeneity quota: {error}", file=sys.stderr)
        return 2
    except LaunchError as error:
        excerpt = failure_excerpt(out_dir / files.WORKER_LOG)
        if excerpt:
            err.print(excerpt, markup=False, highlight=False, soft_wrap=True)
        print(f"cannikin demo: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"cannikin demo: interrupted; logs are in {out_dir}", file=sys.stderr)
        return 130
    Console().print(render_table(report))
    print(f"wall time {report['wall_s']:.1f} s (start-up, {len(report['phases'])} runs and "
          "evaluation)")
    if args.json is not None:
        files.write_json(args.json, report)
    if args.out is None:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0
