"""Worker for tests/test_netns.py: train a few steps, report the fitted communication model.

An MLP 64-H-H-10 (``--hidden``; H = 1024 is 1.1 M parameters, 4.5 MB of float32 gradients)
on random data, wrapped in HeteroDataParallel, for ``--steps`` steps. Rank 0 prints one line
``comm {json}`` with the fitted all-reduce buckets (``model.cluster_model.comm``), their sum,
the gradient bytes and the median measured step time, so the test can compare the fit with
the link it ran over.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.log import setup_logging
from cannikin.runtime.distributed import destroy_distributed, init_distributed
from cannikin.runtime.loader import HeteroDataLoader
from cannikin.runtime.parallel import HeteroDataParallel


class StepTimes:
    """Metrics sink (rank 0): the measured step times."""

    def __init__(self) -> None:
        self.step_s: list[float] = []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if metrics.get("step_time_s") is not None:
            self.step_s.append(float(metrics["step_time_s"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=60)
    setup_logging(ctx.rank)
    generator = torch.Generator().manual_seed(0)
    samples = args.batch_size * args.steps
    dataset = TensorDataset(torch.randn(samples, 64, generator=generator),
                            torch.randint(0, 10, (samples,), generator=generator))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    loader = HeteroDataLoader(dataset, batch_size=args.batch_size, seed=0)
    times = StepTimes()
    model = HeteroDataParallel(net, optimizer, loader, metrics=times)
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    cluster = model.cluster_model
    if ctx.rank == 0:
        assert cluster is not None, "no fitted model after the warm-up steps"
        buckets = [list(b) for b in cluster.comm.buckets]
        print("comm " + json.dumps({
            "buckets": buckets, "comm_s": sum(c for _, c in buckets),
            "grad_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
            "median_step_s": statistics.median(times.step_s[len(times.step_s) // 2:]),
            "steps": model.step, "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "master_addr": os.environ.get("MASTER_ADDR")}), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
