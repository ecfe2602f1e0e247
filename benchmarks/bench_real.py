"""Real heterogeneity: Cannikin against plain DDP on CPU-quota workers (no emulation).

Three gloo workers in cgroups limited to 1, 0.5 and 0.25 of a core (10 ms CFS period unless
``--period-ms`` says otherwise, see ``cannikin.runtime.quota``) train an MLP 64-1024-1024-10
(or, with ``--model transformer``, a two-layer transformer encoder that reads a digit's 8
rows as 8 tokens) on scikit-learn's digits with a total batch B = 480. In one run, in
interleaved blocks of steps (every round visits every configuration, in a rotated order, so
the load of a shared machine hits all alike; each block starts with one untimed step of its
own, so that none is timed on the previous one's caches):

* plain torch DDP at the even split;
* Cannikin (HeteroDataParallel, split "optimal"), after a warm-up in which it learns the
  workers and settles its split: 150 steps, and on until its plan is held (re-checked
  every 40 steps and measured every 4th to 16th, as in a long run; 150 steps alone left it
  re-planning every 16-20 steps and measuring every step in the blocks in some runs) and
  no probe or trial is in force, up to 600 steps;
* plain DDP at Cannikin's split (as it stood after the warm-up: one it chose, not a probe's);
* plain DDP at a sweep of fixed splits, including 0 samples for the slowest worker;
* Cannikin held (a second HeteroDataParallel, its split pinned with ``pin_split`` block by
  block) at Cannikin's split and at a split 2x away (the fastest worker's batch halved,
  the others sharing what it gave up): at its own split, the runtime's per-step cost
  without its planning (re-plans, probes, trials); 2x away, a step that Cannikin's model
  must predict away from the split in use;
* Cannikin held even: a third one, pinned at the even split from the start, as a job at
  the even split runs (one pinned to each split in turn, block by block, cost 1-2 ms more
  CPU per step there than this one); the runtime's cost at the even split, and a step the
  model must predict.

Cannikin's steps call ``model.backward(loss)``, which puts each rank's weight b_i / B in the
backward's seed; one more configuration, Cannikin held at its split with a plain
``loss.backward()``, shows what that saves (the hook then scales every gradient). Another,
Cannikin held even with ``hook_free=False``, shows what the hook-free twin saves at the
even split (every step then takes the comm hook).

Cannikin's model as fitted by the end predicts every configuration's step; its error is
reported against the held runs (the model describes Cannikin's steps) and against plain
DDP's. Each rank's process CPU per step (every thread) shows where the runtime's own work
lands: on a quota worker, one ms of CPU costs 1 / share ms of wall time.

The data set is the first 3 B samples of the digits, so that every step is a full batch in
every configuration: with all 1797 samples every fourth Cannikin step would be the epoch's
partial batch of 357 (split evenly before a model exists), while DDP's steps wrap around.

Plain DDP where rank i draws b_i samples and scales its summed loss by n / B computes the
exact mean gradient for any fixed split, so the best of these is the ground truth for the
best fixed split. Each configuration's figure is B / (median over rounds of its block's
step time); ratios are to the best configuration. Cannikin's prediction error is
|predicted - measured| / measured of the mean step time per block (its model's predicted
step time for the split in force against the block's wall time per step), median over
blocks; its own tracker's window and step medians follow (they include the warm-up), and
the window median over the splits it chose for speed alone (the optimal split's; a probe's,
a trial's at 0 samples and a pinned split's windows left out). Past the warm-up those
windows span Cannikin's blocks between the other configurations', not a training job's
steps: ``bench_prediction.py`` runs Cannikin alone and judges the windows.
Before the blocks every worker times the same compute (forward and backward of B / 3
samples on a model of its own) at once: the workers' real relative speeds.

Each ratio is printed with its median's 95% bootstrap interval over rounds. The 19
configurations leave room for short blocks only, whose ratios cannot resolve the 3-5%
overhead targets; ``--no-sweep`` keeps the seven that the overhead ratios need (no sweep, no
split 2x away), for more rounds of longer blocks (``--no-sweep --rounds 60 --block-steps
8``). ``bench_prediction.py`` judges the model away from its split and the windows.

Run: ``python benchmarks/bench_real.py`` (as root where the cgroup cpu controller is
writable; elsewhere it exits 2 with one line naming the fallback, ``bench_runtime.py``'s
emulated speeds). Figures only, no asserts on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the parent imports this checkout's quota module

from cannikin.runtime.quota import DEFAULT_PERIOD_US, QuotaGroups, QuotaUnavailable  # noqa: E402

SHARES = (1.0, 0.5, 0.25)
TOTAL = 480
WIDTH = 1024
LR = 0.05
MODELS = {"mlp": f"MLP 64-{WIDTH}-{WIDTH}-10",
          "transformer": "transformer encoder (2 layers, width 64, 4 heads; a digit's 8 rows "
                         "as 8 tokens)"}
"""The networks ``--model`` names: the MLP, and one whose CPU per sample grows with the
batch, with 28 parameter tensors where the MLP has 6."""
PLAIN_BACKWARD = "Cannikin held, loss.backward()"
"""Cannikin held at its split with the weight applied by the hook, not the backward's seed."""
HOOKED_EVEN = "Cannikin held even, hook_free=False"
"""Cannikin held at the even split with every step through the comm hook (no hook-free
twin): what the twin saves there."""
SWEEP = [(TOTAL - mid - slow, mid, slow) for slow in (0, 30, 60) for mid in (90, 120, 150, 180)]
"""Fixed splits (fastest, middle, slowest): the slowest gets 0 to 60 samples."""


def digits() -> tuple[Any, Any]:
    """The first 3 B digits (full batches only, see the docstring): inputs and labels."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    x_all = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y_all = torch.tensor(data.target, dtype=torch.int64)
    return x_all[: 3 * TOTAL], y_all[: 3 * TOTAL]


def network(model: str = "mlp") -> Any:
    """The network ``model`` (a :data:`MODELS` name), the same initial weights on every
    rank and call."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model == "mlp":
        return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                             nn.ReLU(), nn.Linear(WIDTH, 10))
    if model != "transformer":
        raise ValueError(f"model {model!r}: one of {sorted(MODELS)}")

    class DigitTransformer(nn.Module):
        """A digit's 8 rows of 8 pixels as 8 tokens, two encoder layers, mean-pooled."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(x.view(-1, 8, 8))).mean(dim=1))

    return DigitTransformer()


def cannikin(x_all: Any, y_all: Any, hook_free: bool = True,
             model: str = "mlp") -> tuple[Any, Callable[..., None]]:
    """A fresh Cannikin (split "optimal", the workers' real speeds) training ``model`` on
    ``x_all, y_all`` and its training step, epoch after epoch; ``step(seeded=False)`` backs
    the loss up with a plain ``loss.backward()`` instead of ``model.backward(loss)``."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from cannikin.runtime import HeteroDataLoader, HeteroDataParallel

    net = network(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    loader = HeteroDataLoader(TensorDataset(x_all, y_all), batch_size=TOTAL, seed=0)
    wrapped = HeteroDataParallel(net, opt, loader, split="optimal", slowdown=None,
                                 hook_free=hook_free)
    batches = (batch for _ in range(100_000) for batch in loader)

    def step(seeded: bool = True) -> None:
        x, y = next(batches)
        opt.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        if seeded:
            wrapped.backward(loss)
        else:
            loss.backward()
        opt.step()

    return wrapped, step


def even_split(world: int) -> tuple[int, ...]:
    """B over ``world`` workers as evenly as whole samples allow."""
    return tuple(TOTAL // world + (r < TOTAL % world) for r in range(world))


def plain_ddp(x_all: Any, y_all: Any, rank: int, world: int,
              model: str = "mlp") -> Callable[[tuple[int, ...]], None]:
    """A fresh plain torch DDP ``model``'s training step at a given split: rank i takes b_i of
    each step's B samples (in a fixed shuffled order) and scales its summed loss by n / B,
    the exact mean gradient for any fixed split."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    net = network(model)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0))
    cursor = [0]

    def step(split: tuple[int, ...]) -> None:
        begin = cursor[0] + sum(split[:rank])
        idx = order[torch.arange(begin, begin + split[rank]) % len(order)]
        cursor[0] = (cursor[0] + TOTAL) % len(order)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x_all[idx]), y_all[idx], reduction="sum") * (world / TOTAL)
        loss.backward()
        opt.step()

    return step


def _worker(out: Path, rounds: int, block_steps: int, warmup_steps: int,
            sweep: bool, model: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from cannikin.runtime import init_distributed
    from cannikin.runtime.quota import join_from_env

    x_all, y_all = digits()
    rank = int(os.environ["RANK"])
    share = join_from_env(rank)  # after the imports: a 25% worker imports torch 4x slower
    torch.set_num_threads(1)
    ctx = init_distributed("gloo")
    world = ctx.world_size

    # -- the workers' real speeds: the same compute on every rank at once ---------------------
    alone = network(model)
    xs, ys = x_all[: TOTAL // world], y_all[: TOTAL // world]
    F.cross_entropy(alone(xs), ys).backward()  # warm the allocator
    dist.barrier()
    start = time.perf_counter()
    for _ in range(8):
        F.cross_entropy(alone(xs), ys).backward()
    compute_s = (time.perf_counter() - start) / 8

    ddp_step = plain_ddp(x_all, y_all, rank, world, model)

    # -- Cannikin ------------------------------------------------------------------------------
    hdp, free_step = cannikin(x_all, y_all, model=model)
    predicted: list[float] = []

    def hdp_step() -> None:
        free_step()
        p = hdp.last_metrics.get("predicted_step_time_s")
        if p is not None:
            predicted.append(float(p))

    for _ in range(warmup_steps):
        hdp_step()

    def settled() -> bool:
        # a probe's or a trial's split is not the one Cannikin chose; and a plan not held
        # yet is measured every step, as only its first ~75 steps are in a long run
        return not hdp.plan_history[-1].exploring and hdp.planner.held

    steps = warmup_steps
    while not settled() and steps < 4 * warmup_steps:
        hdp_step()
        steps += 1
    warm_settled = settled()
    cannikin_split = tuple(hdp.plan.local_batches)
    warm_plans = len(hdp.plan_history)
    even = even_split(world)
    ddp_step(even)  # DDP's first steps rebuild its buckets: not timed
    ddp_step(even)

    held, held_step = cannikin(x_all, y_all, model=model)

    away = two_x_away(cannikin_split)
    held.pin_split(cannikin_split)
    resident = {name: cannikin(x_all, y_all, hook_free=name != HOOKED_EVEN, model=model)
                for name in ("Cannikin held even", HOOKED_EVEN)}  # pinned even throughout
    for wrapped, _ in resident.values():
        wrapped.pin_split(even)
    for _ in range(3):
        for run in (held_step, *(step for _, step in resident.values())):
            run()
    configs: dict[str, tuple[int, ...] | None] = {"DDP even": even, "Cannikin": None,
                                                 "DDP at Cannikin's split": cannikin_split}
    pinned = {"Cannikin held at its split": cannikin_split, PLAIN_BACKWARD: cannikin_split}
    configs.update({name: even for name in resident})
    if sweep:
        configs.update({"DDP " + "/".join(map(str, s)): s for s in SWEEP if s not in
                        (even, cannikin_split)})
        pinned["Cannikin held 2x away"] = away
    configs.update(pinned)
    names = list(configs)
    blocks: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    errors: list[tuple[float, float]] = []  # Cannikin per block: (predicted, measured)
    def runner(name: str) -> tuple[Any, Callable[[], None]]:
        """The block's Cannikin (None: plain DDP's) and its step."""
        split = configs[name]
        if split is None:
            return hdp, hdp_step
        if name in resident:
            return resident[name]
        if name in pinned:
            held.pin_split(split)
            return held, lambda: held_step(name != PLAIN_BACKWARD)
        return None, lambda: ddp_step(split)

    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            split = configs[name]
            model, step = runner(name)
            if model is not None:
                with torch.no_grad():  # marks the other blocks as a pause between steps:
                    model(x_all[:1])  # not measured (runtime.md)
            # one untimed step of the block's own configuration: the first step after another
            # configuration runs on caches that its model filled (Cannikin's model was cold
            # after every DDP block, while the DDP configurations share one model)
            step()
            predicted.clear()
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(block_steps):
                step()
            dist.barrier()
            step_s = (time.perf_counter() - start) / block_steps
            blocks[name].append(step_s)
            cpu[name].append((time.process_time() - cpu_start) / block_steps)
            if split is None and predicted:
                errors.append((statistics.fmean(predicted), step_s))
    cpu_ms = [None] * world  # each rank's median CPU per step, by configuration
    dist.all_gather_object(cpu_ms, {k: 1e3 * statistics.median(v) for k, v in cpu.items()})
    speeds = [0.0] * world
    dist.all_gather_object(speeds, compute_s)
    shares = [0.0] * world
    dist.all_gather_object(shares, share)
    if rank == 0:
        tracker = hdp.prediction_tracker
        model = hdp.cluster_model  # as fitted by the end: its prediction of every split
        model_s = {name: None if model is None else model.expected_step_time(
            list(split or hdp.plan.local_batches)) for name, split in configs.items()}
        slowest_s = {name: None if model is None else model.step_time(
            list(split or hdp.plan.local_batches)) for name, split in configs.items()}
        out.write_text(json.dumps({
            "world": world, "shares": shares, "compute_s": speeds, "blocks": blocks,
            "splits": {k: list(v) if v else None for k, v in configs.items()},
            "cannikin_final": list(hdp.plan.local_batches), "cannikin_warm": list(cannikin_split),
            "errors": errors, "plans": len(hdp.plan_history), "model_s": model_s,
            "warmup": steps, "settled": warm_settled,
            "block_plans": [[r.step, r.reason, list(r.local_batches)]
                            for r in hdp.plan_history[warm_plans:]],
            "cpu_ms": cpu_ms, "slowest_s": slowest_s,
            "costly": [[w.rank, w.cost_s, w.speedup] for w in hdp.plan_history[-1].costly],
            "cpu_floors": [nd.cpu_floor for nd in model.nodes] if model else [None] * world,
            "cpu_levels": [sorted(f.level_medians().items())
                           for f in hdp.planner.cpu_fitters],
            "tracker_window": tracker.median_window_error(),
            "tracker_chosen": hdp.planner.chosen_tracker.median_window_error(),
            "chosen_windows": len(hdp.planner.chosen_tracker.window_errors()),
            "plan_stall_s": hdp.planner.plan_stall_s,
            "tracker_step": tracker.median_step_error(),
            "even_parts": None if model is None else model_parts(model, even),
        }))
    for wrapped in (hdp, held, *(model for model, _ in resident.values())):
        wrapped.remove_hooks()
    dist.destroy_process_group()


def model_parts(model: Any, split: tuple[int, ...]) -> dict[str, Any]:
    """The model's parts at ``split``: each worker's compute, its path (the compute and the
    all-reduce left after it) and its CPU floor, and the all-reduce's total with every
    worker busy and with one idle (ms)."""
    import numpy as np

    arr = model.arrays
    batches = np.asarray(split, dtype=np.float64)
    path, compute, row, x = arr.compute_paths(batches)
    floors = arr.floors(batches, row, x) if arr.floored else np.full(len(split), np.nan)
    idle = None if model.idle_comm is None else 1e3 * model.idle_comm.total
    return {"compute": (1e3 * compute).tolist(), "path": (1e3 * path).tolist(),
            "floor": (1e3 * floors).tolist(), "comm": 1e3 * model.comm.total, "idle_comm": idle}


def two_x_away(split: tuple[int, ...]) -> tuple[int, ...]:
    """``split`` with the fastest worker's (rank 0) batch halved and the samples it gives
    up shared evenly by the others: every worker's batch 2x off or more."""
    given = split[0] - split[0] // 2
    others = len(split) - 1
    return (split[0] // 2, *(b + given // others + (i < given % others)
                             for i, b in enumerate(split[1:])))


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _report(result: dict[str, Any], wall_s: float, load_before: str, load_after: str,
            period_ms: float, model: str) -> None:
    shares, compute = result["shares"], result["compute_s"]
    print(f"bench_real: {result['world']} gloo workers on CPU quotas "
          f"{', '.join(f'{s:g}' for s in shares)} of a core ({period_ms:g} ms "
          f"period), {MODELS[model]} on digits, B = {TOTAL}")
    print(f"load average before {load_before}, after {load_after}; wall time {wall_s:.0f} s")
    fastest = min(compute)
    print(f"measured speeds (forward+backward of {TOTAL // len(compute)} samples, every worker "
          "at once): "
          + " : ".join(f"{fastest / c:.2f}" for c in compute)
          + "  (" + ", ".join(f"{1e3 * c:.1f}" for c in compute) + " ms)")
    medians = {name: statistics.median(times) for name, times in result["blocks"].items()}
    best = min(medians.values())
    rounds = len(next(iter(result["blocks"].values())))
    model_s = result["model_s"]
    cpu_ms = result["cpu_ms"]
    print(f"\n{'configuration':28s} {'split':>12s} {'ms/step':>8s} {'IQR':>13s} "
          f"{'samples/s':>10s} {'/ best':>7s} {'model':>7s} {'error':>6s}  "
          f"{'CPU ms/step by rank':>20s}   ({rounds} blocks each, median; model: Cannikin's "
          "final fit's prediction of that split)")
    for name, step_s in sorted(medians.items(), key=lambda kv: kv[1]):
        split = result["splits"][name] or result["cannikin_final"]
        q = statistics.quantiles(result["blocks"][name], n=4)
        predicted = model_s[name]
        model = f"{'':14s}" if predicted is None else (
            f"{1e3 * predicted:7.1f} {100 * (predicted - step_s) / step_s:+5.0f}%")
        cpu = " ".join(f"{rank[name]:5.1f}" for rank in cpu_ms)
        print(f"{name:28s} {'/'.join(map(str, split)):>12s} {1e3 * step_s:8.1f} "
              f"{1e3 * q[0]:6.1f}-{1e3 * q[2]:<6.1f} {TOTAL / step_s:10.0f} "
              f"{best / step_s:7.2f} {model}  {cpu:>20s}")

    def error(name: str) -> float:
        return abs(model_s[name] - medians[name]) / medians[name]

    if model_s["Cannikin"] is not None:
        held = [n for n in medians if n.startswith("Cannikin held")
                and n not in (PLAIN_BACKWARD, HOOKED_EVEN)]
        print("Cannikin's final model against Cannikin held at a split: "
              + ", ".join(f"{n.removeprefix('Cannikin held ')} {100 * error(n):.1f}%"
                          for n in held))
        print("  the same model without its timing noise (the slowest worker's mean): "
              + ", ".join(f"{n.removeprefix('Cannikin held ')} "
                          f"{100 * (result['slowest_s'][n] - medians[n]) / medians[n]:+.1f}%"
                          for n in held))
        ddp = [n for n in medians if n.startswith("DDP")]
        print(f"Cannikin's final model against plain DDP's measured steps, all {len(ddp)} "
              f"fixed splits: median error {100 * statistics.median(map(error, ddp)):.1f}%, "
              f"worst {100 * max(map(error, ddp)):.1f}% (even split: "
              f"{100 * error('DDP even'):.1f}%)")
    parts = result["even_parts"]
    if parts is not None:
        idle = "none" if parts["idle_comm"] is None else f"{parts['idle_comm']:.1f}"
        print("its parts at the even split, by rank (ms): compute "
              + ", ".join(f"{v:.1f}" for v in parts["compute"]) + "; path (compute and the "
              "all-reduce left) " + ", ".join(f"{v:.1f}" for v in parts["path"])
              + "; CPU floor " + ", ".join(f"{v:.1f}" for v in parts["floor"])
              + f"; all-reduce in all, every worker busy {parts['comm']:.1f}, one idle {idle}")
    if any(result["cpu_floors"]):
        print("Cannikin's CPU floors (CPU per step over the worker's cores), and the median "
              "CPU per step at each batch size they rest on (batch: ms):")
        for rank, (floor, levels) in enumerate(zip(result["cpu_floors"], result["cpu_levels"],
                                                   strict=True)):
            line = "none" if floor is None else (
                f"{1e3 * floor[0]:.1f} ms + {1e3 * floor[1]:.3f} ms/sample")
            seen = ", ".join(f"{b:g}: {1e3 * c:.1f}" for b, c in levels)
            print(f"  rank {rank}: {line}; {seen}")
    warm, final = result["cannikin_warm"], result["cannikin_final"]
    moved = "" if warm == final else f" (after the warm-up: {'/'.join(map(str, warm))})"
    held = ("ending on a held plan (measured every 4th step, then every 8th and 16th while it "
            "holds)" if result["settled"] else "its plan not held by then")
    print(f"\nCannikin's split {'/'.join(map(str, final))}{moved}, {result['plans']} plans; "
          f"warm-up {result['warmup']} steps, {held}")
    print("its plans in the blocks: " + ("; ".join(
        f"step {step} {reason} {'/'.join(map(str, split))}"
        for step, reason, split in result["block_plans"]) or "none"))
    print("workers its last plan reports as slowing the step at 0 samples: " + (", ".join(
        f"rank {rank} ({1e3 * cost:.1f} ms per step, predicted {speedup:.2f}x faster without "
        "it)" for rank, cost, speedup in result["costly"]) or "none"))
    errors = result["errors"]
    if errors:
        error = statistics.median(abs(p - m) / m for p, m in errors)
        pred = statistics.median(p for p, _ in errors)
        meas = statistics.median(m for _, m in errors)
        print(f"Cannikin prediction error per block: median {100 * error:.1f}%"
              f" (predicted {1e3 * pred:.1f} ms vs measured {1e3 * meas:.1f} ms, medians over "
              f"{len(errors)} blocks)")
    print(f"Cannikin's own tracker (warm-up included): window median "
          f"{100 * result['tracker_window']:.1f}%, step median {100 * result['tracker_step']:.1f}%;"
          f" at the splits it chose (probes, trials at 0 left out): window median "
          f"{100 * result['tracker_chosen']:.1f}% over {result['chosen_windows']} windows "
          f"(past the warm-up, windows of blocks between the other configurations')")
    stall = result["plan_stall_s"]
    print("a re-plan holds up the step after it by (the slowest rank's re-plan, median of the "
          "last few): " + ("none measured" if stall is None else f"{1e3 * stall:.1f} ms"))
    swept = sum(name.startswith("DDP") for name in result["blocks"]) > 2
    print("Ratios of step times, each the median over rounds of the ratio within a round "
          "(a round's blocks run back to back, so the machine's load is shared), with the IQR "
          "over rounds and the median's 95% bootstrap interval (rounds resampled):")
    for label, a, b in (("Cannikin / plain DDP at the same split", "Cannikin",
                         "DDP at Cannikin's split"),
                        ("Cannikin held there / plain DDP", "Cannikin held at its split",
                         "DDP at Cannikin's split"),
                        ("  the same with loss.backward()", PLAIN_BACKWARD,
                         "DDP at Cannikin's split"),
                        ("Cannikin held even / DDP even", "Cannikin held even", "DDP even"),
                        ("  the same with hook_free=False", HOOKED_EVEN, "DDP even"),
                        (f"Cannikin / the best {'fixed' if swept else 'DDP'} split",
                         "Cannikin", None)):
        _print_ratio(label, _paired_ratio(result["blocks"], a, b))
    if swept:
        held_out, chosen = _held_out_best_ratio(result["blocks"], "Cannikin")
        _print_ratio("  that split chosen on the other rounds", held_out)
        count = sum(name.startswith("DDP") for name in result["blocks"])
        print(f"    (the best on the odd rounds: {chosen[0].removeprefix('DDP ')}; on the "
              f"even: {chosen[1].removeprefix('DDP ')}. Chosen on the rounds it is measured "
              f"on, the least of {count} medians within noise of each other is biased low)")


def _print_ratio(label: str, r: PairedRatio) -> None:
    print(f"  {label:40s} {r.median:.3f}x  (IQR {r.q1:.3f}-{r.q3:.3f}; the median "
          f"{r.low:.3f}-{r.high:.3f})")


class PairedRatio(NamedTuple):
    """A ratio's median over rounds, its quartiles, and the median's 95% interval."""

    median: float
    q1: float
    q3: float
    low: float
    """The 2.5th percentile of the median over resamples of the rounds."""
    high: float
    """The 97.5th."""


def _best_ddp(blocks: dict[str, list[float]], rounds: Sequence[int]) -> str:
    """The plain DDP configuration of the lowest median step over these rounds."""
    return min((n for n in blocks if n.startswith("DDP")),
               key=lambda n: statistics.median(blocks[n][r] for r in rounds))


def _paired_ratio(blocks: dict[str, list[float]], name: str, other: str | None,
                  resamples: int = 2000) -> PairedRatio:
    """Median and quartiles over rounds of ``name``'s step time over ``other``'s in the same
    round, and the median's 95% bootstrap interval: whether a figure resolves a 3% target
    (with 20 rounds of 4 steps the intervals were 16-39% wide). ``other`` None: the plain
    DDP configuration of the lowest median (the best of each round would be a minimum of
    noisy times, biased low)."""
    import numpy as np

    if other is None:
        other = _best_ddp(blocks, range(len(blocks[name])))
    return _summary(np.asarray(blocks[name]) / np.asarray(blocks[other]), resamples)


def _held_out_best_ratio(blocks: dict[str, list[float]], name: str,
                         resamples: int = 2000) -> tuple[PairedRatio, tuple[str, str]]:
    """:func:`_paired_ratio` against the best plain DDP split, that split chosen on the
    other half of the rounds (odd against even, and even against odd), and the two chosen.

    Chosen on the rounds it is measured on, the best of many splits within noise of each
    other is the one whose noise ran lowest there: a minimum of noisy medians, biased low,
    so the ratio against it is biased high (a winner's curse). Chosen on other rounds, its
    noise in these is the others' (with 14 splits of the same true time and 10% noise per
    block, over 300 simulated runs the in-sample ratio's median averaged 1.028, this one
    1.001; ``tests/test_bench_real.py``)."""
    import numpy as np

    count = len(blocks[name])
    chosen = []
    ratios = np.empty(count)
    for parity in (0, 1):
        here = [r for r in range(count) if r % 2 == parity]
        best = _best_ddp(blocks, [r for r in range(count) if r % 2 != parity])
        chosen.append(best)
        ratios[here] = np.asarray(blocks[name])[here] / np.asarray(blocks[best])[here]
    return _summary(ratios, resamples), (chosen[0], chosen[1])


def _summary(ratios: Any, resamples: int) -> PairedRatio:
    """A :class:`PairedRatio` of per-round ratios, its interval over ``resamples``."""
    import numpy as np

    picks = np.random.default_rng(0).integers(0, ratios.size, size=(resamples, ratios.size))
    low, high = np.quantile(np.median(ratios[picks], axis=1), [0.025, 0.975])
    q1, median, q3 = np.quantile(ratios, [0.25, 0.5, 0.75])
    return PairedRatio(float(median), float(q1), float(q3), float(low), float(high))


def main() -> int:
    parser = argparse.ArgumentParser(description="Cannikin vs plain DDP on CPU-quota workers")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=20,
                        help="blocks per configuration (with 20, the ratios' 95%% intervals "
                             "were 16-39%% wide in one run)")
    parser.add_argument("--block-steps", type=int, default=4, help="steps per block")
    parser.add_argument("--warmup-steps", type=int, default=150,
                        help="Cannikin steps before the blocks (it learns and settles), and "
                             "on until its plan is held and no probe or trial is in force, "
                             "up to 4x as many")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false",
                        help="leave out the fixed splits' sweep and the split 2x away: 7 "
                             "configurations, so that enough rounds of long blocks fit for "
                             "the overhead ratios' intervals to resolve the 3-5%% targets "
                             "(--rounds 60 --block-steps 8: ~5 min here)")
    add_period_option(parser)
    add_model_option(parser)
    args = parser.parse_args()
    for name, least in (("rounds", 2), ("block_steps", 1), ("warmup_steps", 1)):
        if getattr(args, name) < least:  # the IQRs over rounds need two
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {least}")
    if args.worker is not None:
        _worker(args.worker, args.rounds, args.block_steps, args.warmup_steps, args.sweep,
                args.model)
        return 0
    load_before = _loadavg()
    start = time.monotonic()
    result = launch_on_quotas(Path(__file__), [
        "--rounds", str(args.rounds), "--block-steps", str(args.block_steps), "--warmup-steps",
        str(args.warmup_steps), "--model", args.model,
        *([] if args.sweep else ["--no-sweep"])], args.period_ms)
    if isinstance(result, int):
        return result
    _report(result, time.monotonic() - start, load_before, _loadavg(), args.period_ms,
            args.model)
    return 0


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """``--model``: the network the workers train (:data:`MODELS`)."""
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="mlp",
        help="the network (default %(default)s); transformer: a small encoder whose CPU "
             "per sample grows with the batch, with many small parameters")


def add_period_option(parser: argparse.ArgumentParser) -> None:
    """``--period-ms``: the CFS period of the workers' quotas (:func:`launch_on_quotas`)."""
    parser.add_argument(
        "--period-ms", type=float, default=DEFAULT_PERIOD_US / 1000,
        help="CFS period of the quotas in ms (default %(default)g: a steadily slower worker; "
             "100 is the kernel's default and Docker's --cpus' and Kubernetes' CPU limits': "
             "a worker runs at full speed until its quota for the period is spent, then "
             "waits for the next period, so a step's time depends on where it falls in one)")


def launch_on_quotas(script: Path, args: list[str],
                     period_ms: float = DEFAULT_PERIOD_US / 1000) -> dict[str, Any] | int:
    """Run ``script --worker OUT *args`` as one gloo worker per :data:`SHARES` entry, each
    in its CPU quota of every ``period_ms``: what the workers wrote to OUT, or the exit code
    (2: no writable cgroups, with the one line that names the fallback, or a period the
    kernel refuses, named; 1: the workers failed)."""
    try:
        groups = QuotaGroups.create(SHARES, period_us=round(1000 * period_ms))
    except QuotaUnavailable as err:
        print(f"{script.stem}: {err}; benchmarks/bench_runtime.py measures emulated speeds",
              file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"{script.stem}: --period-ms {period_ms:g}: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, groups:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, **groups.env(), "PYTHONPATH": str(ROOT / "src"),
               "OMP_NUM_THREADS": "1"}
        env.pop("CANNIKIN_SLOWDOWN", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={len(SHARES)}", str(script), "--worker", str(out), *args]
        proc = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{script.stem}: workers failed (exit {proc.returncode}):\n"
                  f"{proc.stderr[-4000:]}", file=sys.stderr)
            return 1
        result: dict[str, Any] = json.loads(out.read_text())
        return result


if __name__ == "__main__":
    sys.exit(main())
