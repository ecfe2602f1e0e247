"""One demo worker, started by torchrun: trains the task's network (the digits CNN by default)
with an even split, then with Cannikin, on the same samples, and writes what the parent needs
to report. With a target accuracy an AdaptDL-like run comes between them, and each run stops
at the target.

Run as ``python -m cannikin.demo.worker --config CONFIG.json --out DIR`` under torchrun. Files
written into DIR (see :mod:`cannikin.demo.files`): rank 0 appends per-step metrics to the
metrics JSONL (including its own local loss, the mean over its b_0 samples of the step: not
the training loss, and its noise depends on the split) and writes one result JSON per phase,
with the full training loss evaluated once at the end; every rank writes the sample indices
it trained on, per epoch (so the parent can check that each epoch saw every sample once),
with its slowdown factor, CPU share (None when emulated) and thread count. Under
``--heterogeneity quota`` each worker first joins its CPU-quota group
(:func:`cannikin.runtime.quota.join_from_env`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from cannikin.demo import files
from cannikin.demo.config import DemoConfig
from cannikin.demo.data import DataSplit, load_split
from cannikin.demo.model import make_model
from cannikin.log import setup_logging
from cannikin.metrics import JsonlSink
from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.distributed import DistContext, destroy_distributed, init_distributed
from cannikin.runtime.emulate import slowdown_from_env
from cannikin.runtime.quota import join_from_env

logger = logging.getLogger("cannikin.demo.worker")  # __name__ is "__main__" under torchrun

MOMENTUM = 0.9
EMULATED_PROFILE = (0.008, 0.0008)
"""(fixed_s, per_sample_s) of the fastest emulated worker's forward pass (slowdown 1; the
backward takes twice as long, slower workers this times their slowdown): 8 ms + 0.8 ms per
sample, well above what the CNN really costs on a busy 2-core machine (a few ms at batch 40),
so the real compute rarely overruns the padding."""


def _evaluate(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``net`` on (x, y), in one pass."""
    net.eval()
    with torch.no_grad():
        logits = net(x)
        loss = F.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    net.train()
    return loss, accuracy


class _TargetWatch:
    """The time-to-accuracy stop (``config.target``): every ``config.eval_every`` samples
    rank 0 evaluates a copy of the weights on the held-out samples (at full speed: the copy
    carries no emulated slowdown), logs it, and tells every rank whether to stop. The time
    it takes is kept out of the run's training time, but the step after it is measured
    longer by its pause (a step time, not a compute time: the fits do not see it)."""

    def __init__(self, config: DemoConfig, data: DataSplit, out: Path, phase: str,
                 rank: int) -> None:
        self.config, self.data, self.rank = config, data, rank
        self.sink = (JsonlSink(out / files.METRICS, phase=phase, kind="eval")
                     if rank == 0 and config.target is not None else None)
        with torch.random.fork_rng():  # rank 0's draws must not differ from the others'
            self.copy = make_model(config.task) if rank == 0 else None
        self.next_eval = config.eval_every
        self.eval_s = 0.0
        self.reached = False
        self.at: dict[str, Any] | None = None
        self.accuracies: list[float] = []

    def check(self, net: torch.nn.Module, seen: int, steps: int, elapsed_s: float) -> bool:
        """After a step: evaluate if due; True once the target is reached (on every rank)."""
        if self.config.target is None or seen < self.next_eval:
            return False
        begin = time.perf_counter()
        self.next_eval = (seen // self.config.eval_every + 1) * self.config.eval_every
        flag = torch.zeros(1)
        if self.copy is not None and self.sink is not None:
            self.copy.load_state_dict(net.state_dict())
            _, accuracy = _evaluate(self.copy, self.data.test_x, self.data.test_y)
            train_s = elapsed_s - self.eval_s
            self.accuracies.append(accuracy)
            self.sink.log({"accuracy": accuracy, "samples": seen, "train_s": train_s}, steps)
            if accuracy >= self.config.target:
                flag[0] = 1.0
                self.at = {"time_to_target_s": train_s, "steps_to_target": steps,
                           "samples_to_target": seen}
        dist.broadcast(flag, src=0)
        self.reached = bool(flag[0] > 0)
        self.eval_s += time.perf_counter() - begin
        return self.reached

    def summary(self) -> dict[str, Any]:
        """What rank 0's result gets: the target, and when it was reached (None: never)."""
        if self.sink is not None:
            self.sink.close()
        reached = self.at or {"time_to_target_s": None, "steps_to_target": None,
                              "samples_to_target": None}
        return {"target": self.config.target, "evaluations": len(self.accuracies), **reached}


def _lr_schedule(config: DemoConfig, optimizer: torch.optim.Optimizer,
                 model: HeteroDataParallel, train_size: int) -> LambdaLR | None:
    """``config.lr_decay``'s schedule, indexed by the optimizer steps (what LambdaLR counts)
    or by AdaScale's progress (docs/runtime.md's pattern); None for a constant rate."""
    if config.lr_decay is None:
        return None
    if config.lr_decay == "progress":
        return LambdaLR(optimizer, lambda _: config.lr_factor(model.scaler.progress, train_size))
    return LambdaLR(optimizer, lambda step: config.lr_factor(step, train_size))


def _train_phase(
    config: DemoConfig, ctx: DistContext, data: DataSplit, phase: str, split: str, out: Path
) -> None:
    torch.manual_seed(config.seed)
    net = make_model(config.task)
    optimizer = torch.optim.SGD(net.parameters(), lr=config.lr, momentum=MOMENTUM, nesterov=True)
    loader = HeteroDataLoader(data.train, batch_size=config.batch_size, seed=config.seed)
    if config.adapts_batch(split):
        loader.autoscale_batch_size(
            config.max_batch_size, local_bsz_bounds=(1, config.max_batch_size)
        )
    sink = JsonlSink(out / files.METRICS, phase=phase, kind="plan") if ctx.rank == 0 else None
    losses = JsonlSink(out / files.METRICS, phase=phase, kind="train") if ctx.rank == 0 else None
    # HeteroDataParallel emulates this rank's speed from CANNIKIN_SLOWDOWN when the parent set
    # it (--heterogeneity emulate); under CPU quotas it is unset and nothing is padded
    model = HeteroDataParallel(
        net, optimizer, loader, split=split, lr_scaling="adascale",
        replan_every=config.replan_every, metrics=sink, slowdown_profile=EMULATED_PROFILE,
    )
    budget = config.sample_budget(len(data.train))
    scheduler = _lr_schedule(config, optimizer, model, len(data.train))
    seen = steps = 0
    indices: list[list[int]] = []
    target = _TargetWatch(config, data, out, phase, ctx.rank)
    dist.barrier()
    start = time.perf_counter()
    while seen < budget and not target.reached:
        indices.append([])
        for x, y, index in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            model.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            total_batch = int(model.last_metrics["total_batch"])  # the same on every rank
            steps += 1
            seen += total_batch
            indices[-1].extend(index.tolist())
            if losses is not None:  # rank 0's own samples only: no extra collective per step
                losses.log(
                    {"rank0_loss": loss.item(), "rank0_batch": len(y), "samples": seen,
                     "total_batch": total_batch,
                     "wall_s": time.perf_counter() - start - target.eval_s},
                    steps,
                )
            if target.check(net, seen, steps, time.perf_counter() - start) or seen >= budget:
                break
    dist.barrier()
    wall_s = time.perf_counter() - start - target.eval_s
    model.remove_hooks()  # also ends the emulated slowdown before the evaluation
    files.write_json(
        out / files.rank_name(phase, ctx.rank),
        {"slowdown": slowdown_from_env(ctx.rank), "cpu_share":
         None if config.cpu_shares is None else config.cpu_shares[ctx.rank],
         "num_threads": torch.get_num_threads(), "epochs": indices},
    )
    if ctx.rank == 0:
        assert sink is not None and losses is not None
        sink.close()
        losses.close()
        final_loss, train_accuracy = _evaluate(net, data.train_x, data.train_y)
        test_loss, accuracy = _evaluate(net, data.test_x, data.test_y)
        tracker = model.prediction_tracker
        result: dict[str, Any] = {
            "phase": phase,
            "split": split,
            "steps": steps,
            "samples": seen,
            "train_size": len(data.train),
            "test_size": len(data.test_y),
            "wall_s": wall_s,
            "final_loss": final_loss,
            "train_accuracy": train_accuracy,
            "test_loss": test_loss,
            "accuracy": accuracy,
            "local_batches": list(model.plan.local_batches),
            "prediction_error_median": tracker.median_window_error(),
            "prediction_error_step_median": tracker.median_step_error(),
            "mean_batch": seen / steps if steps else None,
            "final_batch": int(model.plan.total_batch),
            **target.summary(),
        }
        files.write_json(out / files.result_name(phase), result)
        logger.info("%s: %d steps, %d samples in %.1f s, accuracy %.3f",
                    phase, steps, seen, wall_s, accuracy)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    config = DemoConfig.from_json(json.loads(args.config.read_text(encoding="utf-8")))
    # before the process group's threads start; after the imports, which a 25% worker would
    # take 4x as long to run
    join_from_env(int(os.environ["RANK"]))
    torch.set_num_threads(1)
    ctx = init_distributed(backend="gloo")  # an emulated cluster of CPU workers, GPU or not
    setup_logging(ctx.rank, config.verbose)
    logger.info("process group ready %.1f s after the imports", time.perf_counter() - started)
    data = load_split(args.out / files.SPLIT)
    logger.info("%s loaded: %d training, %d held-out samples", config.task, len(data.train),
                len(data.test_y))
    for phase, split in config.phases:
        _train_phase(config, ctx, data, phase, split, args.out)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
