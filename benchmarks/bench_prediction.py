"""Cannikin's predictions on CPU-quota workers over a long run, judged by the wall clock.

The setting of ``bench_real.py`` (three gloo workers on quotas 1, 0.5 and 0.25 of a core,
MLP 64-1024-1024-10 on the digits, or ``--model transformer``, B = 480), Cannikin alone, no
emulation. Each run trains a fresh model for ``--steps`` steps, then pins three splits in
turn.

* **Windows.** Every plan is a prediction made before its steps ran: the plan's predicted
  step against the mean of the steps it held, timed on rank 0 from one optimizer step's end
  to the next (every step, not only the measured ones Cannikin's own tracker counts). The
  step after a re-plan waits for the slower ranks' share of it and the step of a re-plan
  holds rank 0's own, so both are left out: a re-plan's cost is ``bench_replan``'s subject.
  Probes and trials are counted apart. The windows *once settled* start after the planner
  first held its plan: the split the issue's "at the optimal split" names, where the
  windows before it are the model's first guesses on its way there. Beside them, the error
  of predicting each window by the last window's own mean at the same split: how far this
  machine's speed moves between windows, which no model of the split can foresee; the
  standard error of each window's own mean, which no prediction of that mean can beat;
  and the windows after a move of the split apart from those at the split before, with
  whether the move the model predicted faster ran faster. Last, Cannikin's own account of
  the same run (``Planner.chosen_tracker``, what its metrics report): every step by rank
  0's clock too, the steps a re-plan delays among them, with the re-plan's time added to
  their prediction.
* **The model away from its split.** The model as fitted at the end of the free run
  predicts its own split, the even split and a split 2x away (``bench_real``'s), and the
  three are then pinned in rotated blocks of ``--block-steps`` steps (one untimed step
  after each pin). Besides each prediction's error, the *relative* error: the model's ratio
  of that split's step to its own split's against the measured ratio. The planner chooses
  by such ratios, and a change of the machine's speed since the fit (10% over tens of
  seconds here) moves every split alike and cancels in them (the own split's error enters
  them instead). Each worker's path and CPU floor at the busy splits, and the CPU levels
  the floors rest on, show where a miss comes from.

Run: ``python benchmarks/bench_prediction.py [--runs 3] [--steps 400]`` (root with a
writable cgroup cpu controller; elsewhere it exits 2 naming the emulated fallback).
Figures only, no asserts on timing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real import (  # noqa: E402
    MODELS,
    SHARES,
    TOTAL,
    add_model_option,
    add_period_option,
    cannikin,
    digits,
    even_split,
    launch_on_quotas,
    model_parts,
    two_x_away,
)

MIN_WINDOW_STEPS = 3
"""Fewer timed steps than this in a window make no window (a mean of noise)."""


def _worker(out: Path, runs: int, steps: int, rounds: int, block_steps: int,
            network: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from cannikin.runtime import init_distributed
    from cannikin.runtime.quota import join_from_env

    x_all, y_all = digits()
    join_from_env(int(os.environ["RANK"]))
    torch.set_num_threads(1)
    world = init_distributed("gloo").world_size

    def run() -> dict[str, Any]:
        hdp, step = cannikin(x_all, y_all, model=network)
        ends, held = [], []
        dist.barrier()
        for _ in range(steps):
            step()
            ends.append(time.perf_counter())
            held.append(hdp.planner.held)
        tracked = hdp.planner.chosen_tracker.signed_window_errors()
        history = [[r.step, r.reason, list(r.local_batches), r.predicted_step_s, r.exploring]
                   for r in hdp.plan_history]
        model = hdp.cluster_model
        own = tuple(next(r.local_batches for r in reversed(hdp.plan_history)
                         if not r.exploring))
        even = even_split(world)
        splits = {"its split": own, "even": even, "2x away": two_x_away(own)}
        pinned: dict[str, Any] = {
            name: {"split": list(split), "blocks": [], "predicted": None if model is None
                   else model.expected_step_time(list(split)),
                   # the parts of a split with an idle worker are with_idle's: not these
                   "parts": None if model is None or 0 in split else model_parts(model, split)}
            for name, split in splits.items()}
        cpu_levels = [sorted(f.level_medians().items()) for f in hdp.planner.cpu_fitters]
        names = list(splits)
        for round_ in range(rounds):
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                hdp.pin_split(splits[name])
                step()  # the first step of a split runs on caches the one before filled
                dist.barrier()
                start = time.perf_counter()
                for _ in range(block_steps):
                    step()
                dist.barrier()
                pinned[name]["blocks"].append((time.perf_counter() - start) / block_steps)
        hdp.remove_hooks()
        return {"ends": ends, "held": held, "history": history, "pinned": pinned,
                "tracked": tracked, "cpu_levels": cpu_levels}

    results = [run() for _ in range(runs)]
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"runs": results}))
    dist.destroy_process_group()


def windows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each plan's window of the free run: its predicted step against the mean of the
    steps it held (see the module docstring for the steps left out), with ``kind``
    "chosen" or "explore", ``settled`` (the planner had held a plan by its start) and
    ``persistence``: the error of predicting it by the last chosen window's mean at the same
    split (None: none before it), what the machine's own drift leaves to any model.

    ``noise``: the standard error of the window's own mean over that mean (its steps'
    spread over the square root of their count), what the window's length leaves to a
    prediction of its mean. ``moved``: a chosen window whose split is not the last chosen
    window's (None: the first chosen window, or a probe's or trial's), and ``change`` its
    measured mean over that window's, less 1 (None where it did not move): whether the
    move the model predicted faster ran faster."""
    ends, history = run["ends"], run["history"]
    first_held = next((k for k, held in enumerate(run["held"]) if held), None)
    found: list[dict[str, Any]] = []
    last_at: dict[tuple[int, ...], float] = {}  # the last chosen window's mean, by split
    last_chosen: tuple[tuple[int, ...], float] | None = None  # its split and mean
    for record, following in zip(history, [*history[1:], None], strict=True):
        step, reason, split, predicted, exploring = record
        last = len(ends) if following is None else following[0]  # its re-plan's step
        timed = [ends[k] - ends[k - 1] for k in range(step + 2, last) if k >= 1]
        if predicted is None or len(timed) < MIN_WINDOW_STEPS:
            continue
        measured = statistics.fmean(timed)
        before = None if exploring else last_at.get(tuple(split))
        moved = None if exploring or last_chosen is None else last_chosen[0] != tuple(split)
        found.append({"step": step, "reason": reason, "split": split,
                      "kind": "explore" if exploring else "chosen",
                      "settled": first_held is not None and step >= first_held,
                      "steps": len(timed), "predicted_s": predicted, "measured_s": measured,
                      "error": predicted / measured - 1.0,
                      "persistence": None if before is None else before / measured - 1.0,
                      "noise": statistics.stdev(timed) / math.sqrt(len(timed)) / measured,
                      "moved": moved, "change": (measured / last_chosen[1] - 1.0
                                                 if moved and last_chosen is not None else None)})
        if not exploring:
            last_at[tuple(split)] = measured
            last_chosen = tuple(split), measured
    return found


def away_errors(pinned: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per pinned split: the prediction's error against the median of its blocks, and the
    relative error (its predicted ratio to "its split" against the measured ratio)."""
    measured = {name: statistics.median(p["blocks"]) for name, p in pinned.items()}
    own = pinned["its split"]["predicted"], measured["its split"]
    return {name: (p["predicted"] / measured[name] - 1.0,
                   (p["predicted"] / own[0]) / (measured[name] / own[1]) - 1.0)
            for name, p in pinned.items() if p["predicted"] is not None}


def _report(results: list[dict[str, Any]], steps: int, block_steps: int,
            period_ms: float, model: str) -> None:
    print(f"bench_prediction: {len(SHARES)} gloo workers on CPU quotas "
          f"{', '.join(f'{s:g}' for s in SHARES)} ({period_ms:g} ms period), "
          f"{MODELS[model]}, B = {TOTAL}; "
          f"{len(results)} runs of {steps} free steps, then pinned blocks of {block_steps}")
    settled_all: list[dict[str, Any]] = []
    tracked_all: list[float] = []
    away_all: dict[str, list[tuple[float, float]]] = {}
    for index, run in enumerate(results):
        found = windows(run)
        chosen = [w for w in found if w["kind"] == "chosen"]
        settled = [w for w in chosen if w["settled"]]
        settled_all += settled
        print(f"\nrun {index + 1}: {len(found)} windows ({len(chosen)} at chosen splits, "
              f"{len(settled)} once settled)")
        print(f"  {'step':>5s} {'split':>13s} {'kind':8s} {'steps':>5s} {'predicted':>9s} "
              f"{'measured':>9s} {'error':>7s}  reason")
        for w in found:
            print(f"  {w['step']:5d} {'/'.join(map(str, w['split'])):>13s} "
                  f"{w['kind'] + ('' if w['settled'] else '*'):8s} {w['steps']:5d} "
                  f"{1e3 * w['predicted_s']:7.1f}ms {1e3 * w['measured_s']:7.1f}ms "
                  f"{100 * w['error']:+6.1f}%  {w['reason']}")
        print("  (* before the planner first held its plan)")
        for label, group in (("chosen splits", chosen), ("once settled", settled)):
            if group:
                errors = [w["error"] for w in group]
                print(f"  window error at {label}: median |error| "
                      f"{100 * statistics.median(map(abs, errors)):.1f}%, signed median "
                      f"{100 * statistics.median(errors):+.1f}%")
        print(f"  {_tracked_line(run['tracked'])}")
        tracked_all += run["tracked"]
        for name, pair in away_errors(run["pinned"]).items():
            away_all.setdefault(name, []).append(pair)
            p = run["pinned"][name]
            print(f"  pinned {name:9s} {'/'.join(map(str, p['split'])):>13s}: predicted "
                  f"{1e3 * p['predicted']:6.1f} ms, measured "
                  f"{1e3 * statistics.median(p['blocks']):6.1f} ms (median of "
                  f"{len(p['blocks'])} blocks): error {100 * pair[0]:+.1f}%, relative to "
                  f"its split {100 * pair[1]:+.1f}%")
            if p["parts"] is not None:
                print(f"    {'':9s} by rank (ms): path "
                      + ", ".join(f"{v:.1f}" for v in p["parts"]["path"]) + "; CPU floor "
                      + ", ".join(f"{v:.1f}" for v in p["parts"]["floor"]))
        print("  CPU per step at the batch sizes the floors rest on (batch: ms): " + "; ".join(
            f"rank {rank} " + ", ".join(f"{b:g}: {1e3 * c:.1f}" for b, c in levels)
            for rank, levels in enumerate(run["cpu_levels"])))
    print("\nover all runs:")
    if settled_all:
        errors = [w["error"] for w in settled_all]
        print(f"  window error once settled: median |error| "
              f"{100 * statistics.median(map(abs, errors)):.1f}% over {len(errors)} windows "
              f"(signed median {100 * statistics.median(errors):+.1f}%)")
        paired = [w for w in settled_all if w["persistence"] is not None]
        if paired:
            print(f"  on the {len(paired)} of them that follow a window at the same split: "
                  f"Cannikin {_median_abs(w['error'] for w in paired):.1f}%, the window "
                  f"before's measured mean {_median_abs(w['persistence'] for w in paired):.1f}%"
                  " (median |error|: the machine's drift between windows)")
        print(f"  a window's own mean is known to "
              f"{_median_abs(w['noise'] for w in settled_all):.1f}% (median standard error: "
              "its steps' spread over the root of their count)")
        stayed = [w for w in settled_all if w["moved"] is False]
        moved = [w for w in settled_all if w["moved"]]
        for label, group in (("at the split of the window before", stayed),
                             ("after a move of the split", moved)):
            if group:
                line = (f"  {len(group)} windows {label}: median |error| "
                        f"{_median_abs(w['error'] for w in group):.1f}%, signed median "
                        f"{100 * statistics.median(w['error'] for w in group):+.1f}%")
                if group[0]["moved"]:
                    line += (f"; measured step against the window before: median "
                             f"{100 * statistics.median(w['change'] for w in group):+.1f}%")
                print(line)
    if tracked_all:
        print(f"  {_tracked_line(tracked_all)}")
    for name, pairs in away_all.items():
        print(f"  the model at {name:9s}: error " + ", ".join(f"{100 * a:+.1f}%" for a, _ in pairs)
              + "; relative " + ", ".join(f"{100 * r:+.1f}%" for _, r in pairs))


def _tracked_line(errors: list[float]) -> str:
    """Cannikin's own account of its windows at the splits it chose."""
    if not errors:
        return "Cannikin's own tracker: no window at a chosen split"
    return (f"Cannikin's own tracker, chosen splits: median |error| "
            f"{_median_abs(errors):.1f}% over {len(errors)} windows, signed median "
            f"{100 * statistics.median(errors):+.1f}%")


def _median_abs(errors: Iterable[float]) -> float:
    """Median absolute error, in percent."""
    return 100 * statistics.median(abs(e) for e in errors)


def main() -> int:
    parser = argparse.ArgumentParser(description="Cannikin's predictions on CPU-quota workers")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3, help="fresh models, one after another")
    parser.add_argument("--steps", type=int, default=400, help="free steps per run")
    parser.add_argument("--rounds", type=int, default=10, help="pinned blocks per split")
    parser.add_argument("--block-steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--json", type=Path, help="also write the runs' raw timings here")
    add_period_option(parser)
    add_model_option(parser)
    args = parser.parse_args()
    for name, least in (("runs", 1), ("steps", 50), ("rounds", 1), ("block_steps", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {least}")
    if args.worker is not None:
        _worker(args.worker, args.runs, args.steps, args.rounds, args.block_steps,
                args.model)
        return 0
    result = launch_on_quotas(Path(__file__), [
        "--runs", str(args.runs), "--steps", str(args.steps), "--rounds", str(args.rounds),
        "--block-steps", str(args.block_steps), "--model", args.model], args.period_ms)
    if isinstance(result, int):
        return result
    if args.json is not None:
        args.json.write_text(json.dumps(result))
    _report(result["runs"], args.steps, args.block_steps, args.period_ms, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
