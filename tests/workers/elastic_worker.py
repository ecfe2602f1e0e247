"""Worker for tests/test_elastic.py: HeteroDataParallel training that survives a lost node.

Every rank appends one JSON line per finished step (the dataset indices it trained on) to
``<out>/samples-g<restart>-r<rank>.jsonl``, flushed at once so a SIGKILL loses nothing that
was written; ``run`` (the process id) tells the runs apart, since the restart count is the
agent's own and stays 0 on an agent that restarts a healthy worker for the membership
change. The job checkpoints every ``--checkpoint-every`` steps (``save_training``: rank 0
writes, every rank takes part). On the first run (restart count 0) every rank pauses after
step ``--pause-after`` and touches ``paused-r<rank>`` until the test, having SIGKILLed one
node, creates ``resume``; the survivors' next collective then fails, torchrun restarts them
in a smaller world, and they resume from the newest checkpoint (``resume_training``).
"""

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
from cannikin.runtime.checkpoint import (
    CheckpointManager,
    resume_training,
    save_training,
)
from cannikin.runtime.distributed import destroy_distributed, init_distributed
from cannikin.runtime.loader import HeteroDataLoader
from cannikin.runtime.parallel import HeteroDataParallel


def dataset(num_samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 8, generator=gen)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y, torch.arange(num_samples))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--pause-after", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=15)
    setup_logging(ctx.rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    loader = HeteroDataLoader(dataset(args.samples), batch_size=args.batch, seed=0)
    model = HeteroDataParallel(net, optimizer, loader, replan_every=3)
    manager = CheckpointManager(args.out / "checkpoints", keep=2)
    resume_training(manager, model)  # rank 0 picks the newest readable one; all load it
    log_path = args.out / f"samples-g{ctx.restart_count}-r{ctx.rank}.jsonl"
    with open(log_path, "a", buffering=1) as log:
        def record(**fields: object) -> None:
            log.write(json.dumps({"gen": ctx.restart_count, "run": os.getpid(),
                                  "rank": ctx.rank, "time": time.time(),
                                  "world": ctx.world_size, **fields}) + "\n")

        record(event="start", step=model.step, epoch=loader.epoch,
               position=loader.state_dict()["position"])
        while loader.epoch < args.epochs:
            epoch = loader.epoch
            for x, y, index in loader:
                step = model.step
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y, reduction="sum") / max(len(y), 1)
                loss.backward()
                optimizer.step()
                record(event="step", step=step, epoch=epoch, indices=index.tolist(),
                       loss=loss.item())
                if model.step % args.checkpoint_every == 0:
                    save_training(manager, model)  # every rank; rank 0 writes
                if ctx.restart_count == 0 and step == args.pause_after:
                    (args.out / f"paused-r{ctx.rank}").touch()
                    deadline = time.monotonic() + 60
                    while not (args.out / "resume").exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
        record(event="done", step=model.step)
    destroy_distributed()


if __name__ == "__main__":
    main()
