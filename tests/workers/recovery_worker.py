"""Worker for tests/recovery.py (the faults of benchmarks/bench_recovery.py and
tests/test_recovery.py): HeteroDataParallel training that logs the wall-clock time of events.

Every run (one worker process) appends JSON lines to ``<out>/events-<pid>.jsonl``, flushed at
once so a SIGKILL loses nothing written: ``start``, one ``step`` per finished step (with the
collective timeout in force), ``error`` when a collective fails (then it re-raises, so
torchrun sees the failure), ``done``. A run that starts before ``<out>/fault`` exists trains
until it fails or for ``--max-steps``; one that starts after it (a restart after the fault)
trains ``--steps-after`` steps and exits. Each step sleeps ``--step-sleep`` so that the
agents of a test leave the machine's cores to the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.log import setup_logging
from cannikin.runtime.distributed import destroy_distributed, init_distributed
from cannikin.runtime.loader import HeteroDataLoader
from cannikin.runtime.parallel import HeteroDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--steps-after", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    after_fault = (args.out / "fault").exists()
    ctx = init_distributed()
    setup_logging(ctx.rank)
    with open(args.out / f"events-{os.getpid()}.jsonl", "a", buffering=1) as log:
        def record(event: str, **fields: object) -> None:
            log.write(json.dumps({"event": event, "t": time.time(), "run": os.getpid(),
                                  "agent": int(os.environ.get("RECOVERY_AGENT", "-1")),
                                  "rank": ctx.rank,
                                  "world": ctx.world_size, "after_fault": after_fault,
                                  **fields}) + "\n")

        record("start")
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        x_all = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(x_all, (x_all[:, 0] > 0).long())
        loader = HeteroDataLoader(data, batch_size=32, seed=0)
        model = HeteroDataParallel(net, optimizer, loader, split="even")
        steps = args.steps_after if after_fault else args.max_steps
        try:
            while model.step < steps:
                for x, y in loader:
                    optimizer.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    record("step", step=model.step,
                           timeout_s=model.collective_timeout.current_s)
                    time.sleep(args.step_sleep)
                    if model.step >= steps:
                        break
        except RuntimeError as error:
            record("error", message=str(error)[:300])
            raise
        record("done", step=model.step)
    destroy_distributed()


if __name__ == "__main__":
    main()
