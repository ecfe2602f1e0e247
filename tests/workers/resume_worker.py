"""Worker for tests/test_resume.py: a killed job resumed from its checkpoint matches an
uninterrupted run.

Launched once by ``torchrun --max-restarts=1`` on 2 workers. First run (restart count 0):
for each scenario, an uninterrupted reference run (rank 0 saves its final parameters), then
an interrupted run that checkpoints every ``EVERY`` steps with ``save_training``. The "even"
scenario simply stops at step ``STOP`` (its objects are dropped); in the "optimal" scenario
rank 0 truncates the newest checkpoint (a damaged file) and rank 1 SIGKILLs itself in the
middle of step ``STOP``, so torchrun restarts both workers. Second run: each scenario
resumes with ``resume_training`` and trains to the end; rank 0 writes, per scenario, where
it resumed and how far its parameters are from the reference to ``<out>/figures.json``.

Scenarios: "even" is bitwise-reproducible by construction (even split, dropout, a final
partial batch whose AdaScale gain uses the restored noise scale, per-rank RNG restored);
"optimal" plans the split from measured times (emulated slowdowns 1 and 2), so the split
of a step may differ between runs and only the mean gradient is the same, up to rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.log import setup_logging
from cannikin.runtime.checkpoint import CheckpointManager, resume_training, save_training
from cannikin.runtime.distributed import DistContext, destroy_distributed, init_distributed
from cannikin.runtime.loader import HeteroDataLoader
from cannikin.runtime.parallel import HeteroDataParallel

EPOCHS, BATCH, EVERY, STOP = 3, 24, 5, 19
SCENARIOS: dict[str, dict[str, Any]] = {
    # 250 samples: 10 full steps and a partial one (10 samples) per epoch, 33 steps
    "even": {"split": "even", "samples": 250, "dropout": 0.2, "slowdown": None},
    # 240 samples: 10 full steps per epoch, 30 steps
    "optimal": {"split": "optimal", "samples": 240, "dropout": 0.0, "slowdown": (1.0, 2.0)},
}


def dataset(num_samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 8, generator=gen)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


def build(ctx: DistContext, cfg: dict[str, Any]) -> tuple[HeteroDataParallel, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(cfg["dropout"]),
                        nn.Linear(32, 2))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    loader = HeteroDataLoader(dataset(cfg["samples"]), batch_size=BATCH, seed=3)
    slowdown = cfg["slowdown"][ctx.rank] if cfg["slowdown"] else None
    model = HeteroDataParallel(net, optimizer, loader, split=cfg["split"], replan_every=3,
                               slowdown=slowdown)
    return model, optimizer


def train(ctx: DistContext, name: str, manager: CheckpointManager | None, *,
          resume: bool = False, interrupt: bool = False) -> dict[str, Any]:
    cfg = SCENARIOS[name]
    stop = STOP if interrupt and name == "even" else None
    model, optimizer = build(ctx, cfg)
    resumed = resume_training(manager, model) if resume and manager is not None else None
    splits = []
    while model.loader.epoch < EPOCHS:
        for x, y in model.loader:
            optimizer.zero_grad()
            out = model(x)
            if interrupt and model.step == STOP and name == "optimal":
                die_mid_step(ctx, manager)  # never returns
            loss = F.cross_entropy(out, y) if len(y) else out.sum() * 0.0
            loss.backward()
            optimizer.step()
            splits.append(list(model.plan.local_batches))
            if manager is not None and model.step % EVERY == 0:
                save_training(manager, model, extra={"scenario": name})
            if model.step == stop:  # "even": stop here, the objects are dropped
                model.remove_hooks()
                return {}
    model.remove_hooks()
    params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"params": params, "steps": model.step, "splits": splits,
            "resumed_step": None if resumed is None else resumed.step,
            "resumed_extra": None if resumed is None else resumed.extra}


def die_mid_step(ctx: DistContext, manager: CheckpointManager | None) -> None:
    """Damage the newest checkpoint (rank 0), then lose rank 1 between forward and backward."""
    assert manager is not None
    if ctx.rank == 0:
        newest = manager.checkpoints()[-1][1]
        data = newest.read_bytes()
        newest.write_bytes(data[: len(data) // 2])
    dist.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # torchrun stops this worker when it sees rank 1 die


def compare(result: dict[str, Any], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    params = result["params"]
    diff = max(float((params[k] - reference[k]).abs().max()) for k in reference)
    scale = max(float(reference[k].abs().max()) for k in reference)
    return {"bitwise": all(torch.equal(params[k], reference[k]) for k in reference),
            "max_abs_diff": diff, "rel_diff": diff / scale, "steps": result["steps"],
            "resumed_step": result["resumed_step"], "resumed_extra": result["resumed_extra"],
            "splits": result["splits"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=30)
    setup_logging(ctx.rank)
    managers = {name: CheckpointManager(args.out / f"ckpt-{name}", keep=3) for name in SCENARIOS}
    if ctx.restart_count == 0:
        for name in SCENARIOS:
            ref = train(ctx, name, None)
            if ctx.rank == 0:
                torch.save({"params": ref["params"], "splits": ref["splits"]},
                           args.out / f"reference-{name}.pt")
        for name in SCENARIOS:
            train(ctx, name, managers[name], interrupt=True)
        raise AssertionError("the optimal scenario should have been killed")
    figures = {}
    for name in SCENARIOS:
        result = train(ctx, name, managers[name], resume=True)
        if ctx.rank == 0:
            reference = torch.load(args.out / f"reference-{name}.pt", weights_only=True)
            figures[name] = compare(result, reference["params"])
            figures[name]["reference_splits"] = reference["splits"]
    if ctx.rank == 0:
        (args.out / "figures.json").write_text(json.dumps(figures))
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
