"""Runtime benchmark: HeteroDataParallel's per-step overhead and its throughput.

1. Overhead: HeteroDataParallel (split="even", all measurement, all-gather, planner
   and LR-scaling work on) vs plain DistributedDataParallel on the same fixed even split
   and the same real (not emulated) model, in alternating blocks of steps so that load
   from other processes hits both alike. Target: < 5% for a step of ~50 ms.
2. Throughput with emulated speeds 1, 2, 4 (slowdowns 4, 2, 1) on 3 workers: even split,
   adapted split, and the ideal, the sum of the workers' speeds (each worker's emulated
   compute rate on the whole batch alone, no communication).

Run: ``python benchmarks/bench_runtime.py`` (launches torchrun on itself, 3 gloo workers).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLOWDOWNS = (4.0, 2.0, 1.0)
PROFILE = (0.004, 0.0004)  # emulated reference forward: fixed_s, per_sample_s
BACKWARD_SCALE = 2.0  # emulate's default: backward = 2x forward
TOTAL = 96
LOCAL = 416  # overhead part: local batch per worker (a ~50 ms plain-DDP step here)


def _worker(out: Path, blocks: int, block_steps: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import TensorDataset

    from cannikin.runtime import HeteroDataLoader, HeteroDataParallel, init_distributed

    torch.set_num_threads(1)
    ctx = init_distributed("gloo")
    rank, world = ctx.rank, ctx.world_size
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 256, generator=gen),
                         torch.randint(0, 10, (n,), generator=gen))

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                             nn.Linear(512, 10))

    # -- 1. overhead ------------------------------------------------------------------------
    spent = _instrument()
    batch = 3 * LOCAL
    ddp_net = net()
    ddp = DistributedDataParallel(ddp_net)
    ddp_opt = torch.optim.SGD(ddp_net.parameters(), lr=0.01)
    hdp_net = net()
    hdp_opt = torch.optim.SGD(hdp_net.parameters(), lr=0.01)
    loader = HeteroDataLoader(data, batch_size=batch, seed=0)
    hdp = HeteroDataParallel(hdp_net, hdp_opt, loader, split="even", slowdown=None)
    _time_calls(hdp.ddp, "forward", "ddp forward", spent)  # the DDP inside the wrapper
    hdp_batches = (batch for _ in range(1000) for batch in loader)  # epoch after epoch
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))

    def ddp_step(i: int) -> None:
        idx = perm[(i * batch + rank * LOCAL) % (n - LOCAL):][:LOCAL]
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        ddp_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        ddp_opt.step()

    def hdp_step(i: int) -> None:
        x, y = next(hdp_batches)
        hdp_opt.zero_grad()
        F.cross_entropy(hdp(x), y).backward()
        hdp_opt.step()

    times: dict[str, list[float]] = {"ddp": [], "hdp": []}
    cpu = {"ddp": 0.0, "hdp": 0.0}  # this process's CPU time (all its threads)
    for i in range(3):  # warm both up (DDP bucket rebuild, allocator)
        ddp_step(i)
        hdp_step(i)
    spent.clear()
    for block in range(blocks):
        for name, fn in (("ddp", ddp_step), ("hdp", hdp_step))[:: 1 if block % 2 else -1]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for i in range(block_steps):
                fn(i)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / block_steps)
            cpu[name] += time.process_time() - start_cpu
    hdp.remove_hooks()
    hdp_steps = blocks * block_steps
    cpu_sum = torch.tensor([cpu["ddp"], cpu["hdp"]], dtype=torch.float64)
    dist.all_reduce(cpu_sum)  # the 3 ranks share 2 cores: every rank's CPU is step time
    cpu_per_step = {"ddp": float(cpu_sum[0]) / hdp_steps, "hdp": float(cpu_sum[1]) / hdp_steps}
    inside = {k: v / hdp_steps for k, v in spent.items()}
    inside["forward wrapper (marks, exchange launch)"] = (inside.pop("hdp forward")
                                                         - inside.pop("ddp forward"))
    _uninstrument()

    # -- 2. throughput ------------------------------------------------------------------------
    small = TensorDataset(torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,),
                                                                            generator=gen))
    through: dict[str, Any] = {}
    for split in ("even", "optimal"):
        torch.manual_seed(0)
        model_net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.SGD(model_net.parameters(), lr=0.05)
        hetero_loader = HeteroDataLoader(small, batch_size=TOTAL, seed=0)
        model = HeteroDataParallel(model_net, opt, hetero_loader, split=split,
                                   slowdown=SLOWDOWNS[rank], slowdown_profile=PROFILE)
        stamps = []
        for step, (x, y) in enumerate(hetero_loader):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            stamps.append(time.perf_counter())
            if step + 1 == steps:
                break
        measure = stamps[steps // 2:]  # second half: the adapted split has converged
        step_s = (measure[-1] - measure[0]) / (len(measure) - 1)
        through[split] = {"step_s": step_s, "throughput": TOTAL / step_s,
                          "local_batches": list(model.plan.local_batches),
                          "window_error": model.prediction_tracker.median_window_error(),
                          "step_error": model.prediction_tracker.median_step_error()}
        model.remove_hooks()
    if rank == 0:
        out.write_text(json.dumps({"overhead": times, "cpu": cpu_per_step, "inside": inside,
                                   "throughput": through, "world": world}))
    dist.destroy_process_group()


_PATCHED: list[tuple[Any, str, Any]] = []


def _time_calls(owner: Any, attr: str, label: str, spent: dict[str, float]) -> None:
    """Replace ``owner.attr`` by a wrapper adding its run time to ``spent[label]``."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    _PATCHED.append((owner, attr, original))
    setattr(owner, attr, wrapper)


def _instrument() -> dict[str, float]:
    """Time the runtime's own code paths (seconds summed over steps, this rank)."""
    from cannikin.runtime import loader, parallel

    spent: dict[str, float] = {}
    hdp = parallel.HeteroDataParallel
    _time_calls(hdp, "_before_optimizer_step", "optimizer pre-hook (measure, exchange, plan)",
                spent)
    _time_calls(hdp, "_after_optimizer_step", "optimizer post-hook (LR restore, metrics)", spent)
    _time_calls(hdp, "begin_step", "begin_step", spent)
    _time_calls(loader.HeteroDataLoader, "_fetch", "loader fetch", spent)
    _time_calls(parallel, "weighted_allreduce_hook", "comm hook (scale, |g_i|^2, marks)", spent)
    _time_calls(hdp, "forward", "hdp forward", spent)
    return spent


def _uninstrument() -> None:
    for owner, attr, original in reversed(_PATCHED):
        setattr(owner, attr, original)
    _PATCHED.clear()


def _bootstrap_interval(ddp: list[float], hdp: list[float], resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """95% interval of median(hdp) / median(ddp) - 1, resampling the block pairs (a block of
    each ran back to back, so a pair shares the machine's load)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d, h = np.asarray(ddp), np.asarray(hdp)
    picks = rng.integers(0, d.size, size=(resamples, d.size))
    ratios = np.median(h[picks], axis=1) / np.median(d[picks], axis=1) - 1.0
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(low), float(high)


def _ideal_throughput() -> float:
    """Sum over workers of the emulated compute rate on the whole batch, alone."""
    fixed, per_sample = PROFILE
    return sum(TOTAL / (k * (1 + BACKWARD_SCALE) * (fixed + per_sample * TOTAL))
               for k in SLOWDOWNS)


def main() -> None:
    parser = argparse.ArgumentParser(description="HeteroDataParallel overhead and throughput")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.blocks, args.block_steps, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        env.pop("CANNIKIN_SLOWDOWN", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=3", __file__, "--worker", str(out), "--blocks",
               str(args.blocks), "--block-steps", str(args.block_steps), "--steps",
               str(args.steps)]
        proc = subprocess.run(cmd, env=env, timeout=900, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"benchmark workers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    over = result["overhead"]
    ddp, hdp = statistics.median(over["ddp"]), statistics.median(over["hdp"])
    print("1. per-step overhead, 3 gloo workers, real MLP 256-1024-512-10, local batch "
          f"{LOCAL}")
    print(f"   plain DDP (even split)        {ddp * 1e3:7.1f} ms/step  (median of "
          f"{len(over['ddp'])} blocks)")
    print(f"   HeteroDataParallel (even)     {hdp * 1e3:7.1f} ms/step")
    low, high = _bootstrap_interval(over["ddp"], over["hdp"])
    print(f"   overhead                      {100 * (hdp / ddp - 1):+7.1f} %   (target < 5%; "
          f"95% bootstrap interval over blocks {100 * low:+.1f} % .. {100 * high:+.1f} %)")
    paired = [h / d - 1 for h, d in zip(over["hdp"], over["ddp"], strict=True)]
    quart = statistics.quantiles(paired, n=4)
    print(f"   per-block overhead: median {100 * statistics.median(paired):+.1f} %, "
          f"quartiles {100 * quart[0]:+.1f} % .. {100 * quart[2]:+.1f} %  (wall clock on a "
          "shared machine: noisy)")
    cpu = result["cpu"]
    print(f"   CPU time per step, summed over the ranks (barrier waits included): DDP "
          f"{cpu['ddp'] * 1e3:.1f} ms, HeteroDataParallel {cpu['hdp'] * 1e3:.1f} ms "
          f"({100 * (cpu['hdp'] / cpu['ddp'] - 1):+.1f} %)")
    print("   time inside the runtime's own code per step (rank 0, instrumented; wall clock, "
          "includes the all-reduce launch and the gather DDP's loop does too):")
    for label, seconds in sorted(result["inside"].items(), key=lambda kv: -kv[1]):
        print(f"     {label:46s} {seconds * 1e3:6.2f} ms")
    total = sum(result["inside"].values())
    print(f"     {'total':46s} {total * 1e3:6.2f} ms = {100 * total / ddp:.1f} % of the DDP step")
    th = result["throughput"]
    ideal = _ideal_throughput()
    print("2. throughput, 3 workers, emulated speeds 1, 2, 4, total batch 96")
    for name in ("even", "optimal"):
        t = th[name]
        print(f"   {name:8s} split {str(t['local_batches']):14s} {t['step_s'] * 1e3:6.1f} ms/step"
              f"  {t['throughput']:7.0f} samples/s  ({100 * t['throughput'] / ideal:4.1f}% of "
              f"ideal)  prediction error: window {100 * t['window_error']:.1f}%, step "
              f"{100 * t['step_error']:.1f}%")
    print(f"   ideal (sum of speeds)                {ideal:7.0f} samples/s")
    gain = th["optimal"]["throughput"] / th["even"]["throughput"]
    print(f"   adapted / even throughput: {gain:.2f}x")


if __name__ == "__main__":
    main()
