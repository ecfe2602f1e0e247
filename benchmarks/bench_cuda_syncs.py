"""Host synchronisations per training step on a GPU: plain DDP against HeteroDataParallel.

A host sync (an event wait, a device-to-host copy, a stream synchronise) stops the host
from queueing the next kernels while the GPU finishes: on a fast accelerator every one is a
bubble. The torch profiler records the CUDA runtime calls of each step; this counts those
that block the host, on plain steps and on steps that take the gradient norms, and times
the steps of each wrapper in alternating blocks.

Run on a machine with CUDA: ``python benchmarks/bench_cuda_syncs.py`` (one process, nccl,
cuda:0). Prints a table and, with ``--json PATH``, writes the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
"""CUDA runtime calls that wait for the device."""
COPIES = ("cudaMemcpy", "cudaMemcpyAsync")
"""Copies: a device-to-host one waits for the device (both wrappers copy the batch in)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print where Cannikin's host time goes (cProfile, top 15)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import TensorDataset

    from cannikin.runtime import HeteroDataLoader, HeteroDataParallel

    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_syncs: no CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    n = 16 * args.batch
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 1024, generator=gen),
                         torch.randint(0, 10, (n,), generator=gen))

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 10)).to(device)

    ddp_net = net()
    ddp = DistributedDataParallel(ddp_net, device_ids=[device])
    ddp_opt = torch.optim.Adam(ddp_net.parameters(), lr=1e-4)
    hdp_net = net()
    hdp_opt = torch.optim.Adam(hdp_net.parameters(), lr=1e-4)
    loader = HeteroDataLoader(data, batch_size=args.batch, seed=0)
    hdp = HeteroDataParallel(hdp_net, hdp_opt, loader)
    batches = (b for _ in range(10_000) for b in loader)

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))

    def ddp_step(i: int) -> dict[str, Any]:
        # shuffled samples gathered on the host, as the loader does (and a DataLoader)
        lo = (i * args.batch) % (n - args.batch)
        idx = perm[lo:lo + args.batch]
        ddp_opt.zero_grad()
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        F.cross_entropy(ddp(x.to(device, non_blocking=True)),
                        y.to(device, non_blocking=True)).backward()
        ddp_opt.step()
        return {}

    def hdp_step(i: int) -> dict[str, Any]:
        x, y = next(batches)
        kind = {"norms": hdp._cycle.norms, "measured": hdp._cycle.measuring}
        hdp_opt.zero_grad()
        F.cross_entropy(hdp(x.to(device, non_blocking=True)),
                        y.to(device, non_blocking=True)).backward()
        hdp_opt.step()
        return kind

    def counted(step: Any, i: int) -> tuple[dict[str, Any], Counter[str]]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            kind = step(i)
            torch.cuda.synchronize(device)
        calls = Counter(e.name for e in prof.events() if e.name in SYNCS + COPIES)
        return kind, calls

    for i in range(12):  # warm-up: the planner's warm-up steps, cuBLAS, the allocator
        ddp_step(i)
        hdp_step(i)
    rows: list[dict[str, Any]] = []
    for i in range(12, 12 + 16):
        _, ddp_calls = counted(ddp_step, i)
        kind, hdp_calls = counted(hdp_step, i)
        rows.append({"step": i, **kind, "ddp": dict(ddp_calls), "cannikin": dict(hdp_calls)})
    times: dict[str, list[float]] = {"ddp": [], "cannikin": []}
    for block in range(6):
        for name, step in (("ddp", ddp_step), ("cannikin", hdp_step))[:: 1 if block % 2 else -1]:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for i in range(args.steps):
                step(i)
            torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) / args.steps)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(device)}; "
          f"MLP 1024-4096-4096-10, Adam, batch {args.batch}, one rank (nccl)")
    print("CUDA runtime syncs and copies per step (profiler):")
    for row in rows:
        syncs = [sum(row[w].get(n, 0) for n in SYNCS) for w in ("ddp", "cannikin")]
        print(f"  step {row['step']:3d} norms={row['norms']!s:5} measured={row['measured']!s:5}"
              f"  syncs: ddp {syncs[0]:2d} cannikin {syncs[1]:2d}   ddp {row['ddp']}"
              f"  cannikin {row['cannikin']}")
    ddp_ms = statistics.median(times["ddp"]) * 1e3
    hdp_ms = statistics.median(times["cannikin"]) * 1e3
    print(f"step time, median of 6 alternating blocks of {args.steps}: DDP {ddp_ms:.3f} ms, "
          f"Cannikin {hdp_ms:.3f} ms ({hdp_ms / ddp_ms:.3f}x)")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(args.steps):
            hdp_step(i)
        torch.cuda.synchronize(device)
        profiler.disable()
        print(f"host time of {args.steps} Cannikin steps, by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "times_s": times}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
