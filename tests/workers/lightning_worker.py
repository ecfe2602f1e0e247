"""torchrun worker for tests/test_lightning.py: a LightningModule trained through
``Trainer(strategy=CannikinStrategy(...))``, its gradient checked against one process.

Usage: ``torchrun --standalone --nproc-per-node=2 lightning_worker.py OUT_JSON FOLDER``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler, TQDMProgressBar
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cannikin.integrations.lightning import CannikinStrategy

warnings.filterwarnings("ignore")  # Lightning's advice on workers and loggers


def blobs(n: int = 240) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 16, generator=gen) * 2.0
    y = torch.randint(0, 4, (n,), generator=gen)
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=gen), y, torch.arange(n))


class Classifier(pl.LightningModule):
    """Records each training batch's sample indices and epoch, each step's all-reduced
    gradient (lr 0: fixed weights), and Lightning's count of the epoch's batches against
    the loader's."""

    def __init__(self, lr: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.lr = lr
        self.seen: list[list[int]] = []
        self.epochs: list[int] = []
        self.grads: list[list[torch.Tensor]] = []
        self.logged: list[float] = []
        self.counts: list[dict[str, Any]] = []
        self.hook_free: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.append(idx.tolist())
        self.epochs.append(self.current_epoch)
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, on_step=True, sync_dist=True)
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        trainer = self.trainer
        self.logged.append(float(trainer.callback_metrics["loss"]))
        served = trainer.train_dataloader
        bar = trainer.progress_bar_callback
        self.counts.append({
            "trainer": trainer.num_training_batches,
            "loader": len(served), "epoch": getattr(served, "passes", 1) * served.epoch_steps,
            "bar": bar.train_progress_bar.total if bar is not None and bar.is_enabled
            else None,
            "last": trainer.fit_loop.epoch_loop.batch_progress.is_last_batch})

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append([p.grad.detach().clone() for p in self.net.parameters()])
        self.hook_free.append(self.trainer.strategy.model._cycle.hook_free)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Manual(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class TwoOptimizers(Classifier):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.0),
                torch.optim.SGD(self.net[2].parameters(), lr=0.0)]


class Recorder:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append(metrics)


class PinEven(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        model.pin_split([model.total_batch // model.world_size] * model.world_size)


def trainer(strategy: CannikinStrategy, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def gradient_check(capped: bool = True) -> dict[str, Any]:
    """Rank 0 capped at 5 samples, or (``capped`` False) both at 16: the even split, whose
    steps that measure and exchange nothing run through the hook-free twin."""
    data = blobs()
    module = Classifier()
    reference = copy.deepcopy(module.net)
    sink = Recorder()
    strategy = CannikinStrategy(split="even", max_local_batch=[5, None] if capped else None,
                                metrics=sink)
    pins = [] if capped else [PinEven()]  # held from the start: measured every 4th step
    trainer(strategy, max_steps=6, callbacks=pins).fit(
        module, DataLoader(data, batch_size=16, shuffle=True))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, module.seen)
    worst = loss_err = 0.0
    for step, grads in enumerate(module.grads):
        union = torch.tensor(sorted(i for rank in everyone for i in rank[step]))
        reference.zero_grad()
        loss = F.cross_entropy(reference(data.tensors[0][union]), data.tensors[1][union])
        loss.backward()
        loss_err = max(loss_err, abs(module.logged[step] - float(loss)) / float(loss))
        scale = max(float(q.grad.abs().max()) for q in reference.parameters())
        worst = max(worst, max(float((g - q.grad).abs().max())
                               for g, q in zip(grads, reference.parameters(), strict=True))
                    / scale)
    samples = [i for rank in everyone for step in rank for i in step]
    return {"rel_err": worst, "steps": len(module.grads), "logged_loss_err": loss_err,
            "splits": [row["local_batches"] for row in sink.rows],
            "timings": [[r["step_time_s"], r["fwd_s"], r["bwd_s"]] for r in sink.rows
                        if r["measured"]],
            "samples": len(samples), "distinct": len(set(samples)),
            "hook_free": module.hook_free}


def accumulation() -> dict[str, Any]:
    """``accumulate_grad_batches=3`` with ``batch_size=7`` on 2 ranks: steps of 42 samples,
    rank 0's share in 3 micro-batches of at most 4, the rest on rank 1's; 250 samples, so
    the epoch's last step is 40, in passes of 10, 9 and 9 on rank 1. Each step's gradient
    and each micro-batch's logged loss against one process over the same samples."""
    data = blobs(250)
    module = Classifier()
    reference = copy.deepcopy(module.net)
    sink = Recorder()
    strategy = CannikinStrategy(split="even", max_local_batch=[4, None], metrics=sink)
    run = trainer(strategy, max_epochs=1, accumulate_grad_batches=3)
    run.fit(module, DataLoader(data, batch_size=7, shuffle=True))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, module.seen)
    x, y = data.tensors[0], data.tensors[1]
    worst = loss_err = 0.0
    for step, grads in enumerate(module.grads):
        passes = [rank[3 * step:3 * step + 3] for rank in everyone]
        union = torch.tensor(sorted(i for rank in passes for p in rank for i in p))
        reference.zero_grad()
        F.cross_entropy(reference(x[union]), y[union]).backward()
        scale = max(float(q.grad.abs().max()) for q in reference.parameters())
        worst = max(worst, max(float((g - q.grad).abs().max())
                               for g, q in zip(grads, reference.parameters(), strict=True))
                    / scale)
        for j in range(3):  # the micro-batch's mean loss over every rank's part of it
            part = torch.tensor([i for rank in passes for i in rank[j]])
            with torch.no_grad():
                loss = float(F.cross_entropy(reference(x[part]), y[part]))
            loss_err = max(loss_err, abs(module.logged[3 * step + j] - loss) / loss)
    samples = [i for rank in everyone for batch in rank for i in batch]
    return {"rel_err": worst, "logged_loss_err": loss_err, "steps": len(module.grads),
            "global_step": run.global_step, "batches": run.num_training_batches,
            "splits": [row["local_batches"] for row in sink.rows],
            "passes": [[len(p) for p in rank] for rank in everyone],
            "samples": len(samples), "distinct": len(set(samples))}


def growing_batch() -> dict[str, Any]:
    """The total batch grows from 32 to 64 at the third step (as a goodput re-plan may make
    it; forced here, where the test decides when): the epoch of 240 samples is then 3 + 3
    steps, not the 8 Lightning counted at its start. Two epochs with an epoch-interval
    LR scheduler (halving), the default progress bar on (Rich's, where it is installed);
    then one epoch with ``limit_train_batches=0.5`` and TQDM's bar."""

    class Growing(Classifier):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            planner = strategy._wrapped.planner if strategy._wrapped is not None else None
            if planner is not None and self.trainer.global_step == 2:
                planner.current = dataclasses.replace(planner.current, total_batch=64,
                                                      local_batches=(40, 24))

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5),
                "interval": "epoch"}}

    data = DataLoader(blobs(), batch_size=16, shuffle=True)
    strategy = CannikinStrategy(split="even")
    module = Growing()
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False,
               enable_checkpointing=False, enable_model_summary=False,
               max_epochs=2).fit(module, data)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (module.seen, module.epochs))
    per_epoch: dict[int, list[int]] = {}
    for seen, epochs in everyone:
        for batch, epoch in zip(seen, epochs, strict=True):
            per_epoch.setdefault(epoch, []).extend(batch)
    lr = module.trainer.optimizers[0].param_groups[0]["lr"]
    strategy = CannikinStrategy(split="even")
    limited = Growing()
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False,
               enable_checkpointing=False, enable_model_summary=False, max_epochs=1,
               limit_train_batches=0.5, callbacks=[TQDMProgressBar()]).fit(limited, data)
    bars = [type(module.trainer.progress_bar_callback).__name__,
            type(limited.trainer.progress_bar_callback).__name__]
    return {"counts": module.counts, "lr": lr,
            "epochs": {e: sorted(ids) for e, ids in per_epoch.items()},
            "limited_steps": len(limited.seen), "limited_counts": limited.counts,
            "bars": bars}


def optimal_split() -> dict[str, Any]:
    """Emulated speeds 1/3 and 1: the fast worker gets the larger share; the total batch
    may grow by goodput up to 96."""
    os.environ["CANNIKIN_SLOWDOWN"] = "3,1"
    sink = Recorder()
    strategy = CannikinStrategy(metrics=sink, max_batch_size=96)
    module = Classifier(lr=0.05)
    try:
        trainer(strategy, max_steps=16).fit(
            module, DataLoader(blobs(), batch_size=24, shuffle=True))
    finally:
        del os.environ["CANNIKIN_SLOWDOWN"]
    assert strategy._wrapped is not None
    auto = strategy._wrapped.loader.autoscale
    return {"splits": [row["local_batches"] for row in sink.rows],
            "plans": [(r.step, r.reason, r.local_batches) for r in strategy._wrapped.plan_history],
            "max_batch": None if auto is None else auto.max_batch_size,
            "counts": module.counts}


def resume(folder: Path) -> dict[str, Any]:
    """Five steps, a checkpoint (loaded back with ``weights_only``), then a resumed fit to
    step 7: Cannikin's state comes back with it. (Lightning counts a fit stopped by
    ``max_steps`` as a finished epoch: the resumed one starts the next.)"""
    data = DataLoader(blobs(), batch_size=16, shuffle=True)
    run = trainer(CannikinStrategy(), max_steps=5)
    run.fit(Classifier(lr=0.05), data)
    path = folder / "five.ckpt"
    run.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["cannikin"]
    strategy = CannikinStrategy()
    second = Classifier(lr=0.05)
    trainer(strategy, max_steps=7).fit(second, data, ckpt_path=path)
    assert strategy._wrapped is not None
    return {"saved_step": saved["runtime"]["step"], "saved_position": saved["loader"]["position"],
            "steps_after": len(second.seen), "step_at_end": strategy._wrapped.step,
            "epoch_at_end": strategy._wrapped.loader.epoch}


def mixed_precision() -> dict[str, Any]:
    """``precision="bf16-mixed"`` (CPU autocast, Lightning's mixed-precision plugin)."""
    sink = Recorder()
    module = Classifier(lr=0.05)
    trainer(CannikinStrategy(metrics=sink), max_steps=8, precision="bf16-mixed").fit(
        module, DataLoader(blobs(), batch_size=16, shuffle=True))
    return {"steps": len(sink.rows),
            "bwd_s": [r["bwd_s"] for r in sink.rows if r["measured"]],
            "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters())}


def refusals() -> dict[str, str]:
    loader = DataLoader(blobs(), batch_size=16)
    scheduler = GradientAccumulationScheduler({0: 2})
    cases = {"manual": (Manual(), {}), "two_optimizers": (TwoOptimizers(), {}),
             "accumulation_scheduler": (Classifier(), {"callbacks": [scheduler]})}
    said = {}
    for name, (module, kwargs) in cases.items():
        try:
            trainer(CannikinStrategy(), max_steps=2, **kwargs).fit(module, loader)
            said[name] = "not refused"
        except RuntimeError as error:
            said[name] = str(error)
    try:
        CannikinStrategy(max_micro_batches=4)
        said["max_micro_batches"] = "not refused"
    except ValueError as error:
        said["max_micro_batches"] = str(error)
    return said


class IdleLogged(Classifier):
    """Rank 0 pinned at 0 samples; the loss logged per step and per epoch as the README
    says, ``loss.nan_to_num()`` (the idle rank's mean loss is NaN)."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.losses: list[tuple[float, int]] = []
        self.epoch_loss = float("nan")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss.nan_to_num(), on_step=True, on_epoch=True, sync_dist=True)
        self.losses.append((float(loss.nan_to_num()), len(y)))
        return loss

    def on_train_start(self) -> None:
        self.trainer.strategy.model.pin_split([0, 32])  # the HeteroDataParallel

    def on_train_epoch_end(self) -> None:
        self.epoch_loss = float(self.trainer.callback_metrics["loss_epoch"])


def idle_epoch_loss() -> dict[str, Any]:
    """The epoch's logged mean loss against the mean over the epoch's samples."""
    module = IdleLogged()
    trainer(CannikinStrategy(), max_epochs=1).fit(module, DataLoader(blobs(), batch_size=16,
                                                                     shuffle=True))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, module.losses)
    steps = [step for rank in everyone for step in rank]
    want = sum(value * n for value, n in steps) / sum(n for _, n in steps)
    return {"logged": module.epoch_loss, "want": want,
            "idle": sum(1 for _, n in everyone[0] if n == 0)}


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    folder = Path(sys.argv[2])
    results = {"gradient": gradient_check(), "hook_free": gradient_check(capped=False),
               "accumulation": accumulation(), "growing": growing_batch(),
               "optimal": optimal_split(), "resume": resume(folder), "bf16": mixed_precision(),
               "refused": refusals(), "idle": idle_epoch_loss()}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
