"""PyTorch Lightning: ``Trainer(strategy=CannikinStrategy())`` trains with HeteroDataParallel.

The strategy is Lightning's DDP strategy with three changes. It wraps the LightningModule
in :class:`~cannikin.runtime.HeteroDataParallel` instead of DistributedDataParallel; it
replaces the training DataLoader (the first point where the optimizer and the data both
exist) with a :class:`~cannikin.runtime.HeteroDataLoader` over the same dataset, whose
total batch is the DataLoader's ``batch_size`` times the world size (what DDP trains on),
and attaches the two; and it runs Lightning's closure (training step and backward) before
the optimizer step, not inside it, so the step's pre-hook, where Cannikin measures the step
and reads the per-step exchange, sees the backward done (the AMP plugin already does so).
Validation and test loaders are left as Lightning makes them.

Refused at ``fit()``, by name: manual optimization (and so several optimizers, which
Lightning allows only there) and ``accumulate_grad_batches`` > 1 (Lightning would sum
gradients over steps that each carry their own ``b_i / B``; every rank would also run the
same number of them, where Cannikin gives each worker its own number of passes).
``self.log(..., sync_dist=True)`` during a training step averages the ranks' local means
weighted by their shares ``b_i / B`` (:meth:`CannikinStrategy.reduce`), so a logged loss is
the step's mean loss (DDP's unweighted average of the ranks' means is not, at an uneven
split); an ``on_epoch`` value is weighted by batch size, as Lightning does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.parallel import MetricsSink

_STATE_KEY = "cannikin"


class CannikinStrategy(DDPStrategy):
    """Lightning's DDP with Cannikin's planned split, exact mean gradient and measurements.

    ``split``, ``lr_scaling``, ``replan_every``, ``max_local_batch``,
    ``max_micro_batches`` and ``metrics`` go to :class:`HeteroDataParallel`;
    ``max_batch_size`` (with ``local_bsz_bounds``) lets the total batch grow by goodput
    (:meth:`HeteroDataLoader.autoscale_batch_size`). Other keyword arguments are DDP's.
    """

    strategy_name = "cannikin"

    def __init__(self, *, split: str = "optimal", lr_scaling: str = "auto",
                 replan_every: int = 5, max_local_batch: int | Sequence[int | None] | None = None,
                 max_micro_batches: int = 1, max_batch_size: int | None = None,
                 local_bsz_bounds: tuple[int, int | None] | None = None,
                 metrics: MetricsSink | None = None, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        self._hdp_options: dict[str, Any] = {
            "split": split, "lr_scaling": lr_scaling, "replan_every": replan_every,
            "max_local_batch": max_local_batch, "max_micro_batches": max_micro_batches,
            "metrics": metrics}
        self._autoscale = (max_batch_size, local_bsz_bounds)
        self._restored: dict[str, Any] | None = None
        self._wrapped: HeteroDataParallel | None = None
        """The wrapper of the last fit, kept past its teardown (a checkpoint saved after
        ``fit()`` still carries its state)."""

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        _refuse_unsupported(trainer)
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> HeteroDataParallel:  # type: ignore[override]
        """HeteroDataParallel instead of DistributedDataParallel (attached to the optimizer
        and the loader once both exist, :meth:`process_dataloader`)."""
        self._wrapped = HeteroDataParallel(model, **self._hdp_options, **self._ddp_kwargs)
        return self._wrapped

    def _register_ddp_hooks(self) -> None:
        """Nothing: HeteroDataParallel's own all-reduce hook is the one that must run."""

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader, as a HeteroDataLoader over its dataset (attached to the
        model and the optimizer); any other loader as it is."""
        model = self.model
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (not isinstance(model, HeteroDataParallel) or model._parts is not None
                or trainer is None or not trainer.training or not self.optimizers):
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(f"CannikinStrategy needs the training data as a torch DataLoader "
                            f"(to give each worker its share of every batch), got "
                            f"{type(dataloader).__name__}")
        loader = _hetero_loader(dataloader, self.world_size)
        max_batch, bounds = self._autoscale
        if max_batch is not None:
            loader.autoscale_batch_size(max_batch, local_bsz_bounds=bounds)
        optimizer = self.optimizers[0]
        model.attach(getattr(optimizer, "_optimizer", optimizer), loader)
        if self._restored is not None:
            model.load_runtime_state_dict(self._restored["runtime"])
            loader.load_state_dict(self._restored["loader"])
            self._restored = None
        return loader

    # -- the step --------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | nn.Module | None = None,
                       **kwargs: Any) -> Any:
        """Lightning's closure (training step, backward) first, then the step, whose closure
        hands back the result: the pre-hook that measures the step runs after the backward."""
        result = closure()
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def reduce(self, tensor: Tensor, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Tensor:
        """DDP's reduce, except a mean over the world during a training step: the ranks'
        values weighted by their shares ``b_i / B`` (a rank with no samples counts 0, its
        mean of nothing being NaN)."""
        share = self._wrapped.step_share if self._wrapped is not None else None
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if share is None or not mean or group is not None or not isinstance(tensor, Tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        weighted = tensor * share if share > 0 else torch.zeros_like(tensor)
        dist.all_reduce(weighted)
        return weighted

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Lightning's checkpoint plus Cannikin's state (fitted models, noise scale, total
        batch, step) and the loader's position in its epoch: plain numbers, loadable with
        ``weights_only``. (Lightning keeps a stateful loader's state with its loops' only
        while the fit runs; a checkpoint saved after ``fit()`` would lose it.)"""
        model = self._wrapped
        if model is not None and model._parts is not None:
            checkpoint[_STATE_KEY] = {"runtime": model.runtime_state_dict(),
                                      "loader": model.loader.state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored = checkpoint.get(_STATE_KEY)
        return checkpoint

    def teardown(self) -> None:
        model = self.model
        if isinstance(model, HeteroDataParallel):
            model.remove_hooks()
            self.model = self.lightning_module
        super().teardown()


def _refuse_unsupported(trainer: pl.Trainer) -> None:
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise RuntimeError("CannikinStrategy supports automatic optimization only: with "
                           "manual optimization Lightning does not run the optimizer step "
                           "where Cannikin measures and plans it")
    if trainer.accumulate_grad_batches != 1:
        raise RuntimeError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: gradients summed "
            f"over Lightning's steps would each carry their own b_i / B. Raise the "
            f"DataLoader's batch_size instead, with CannikinStrategy(max_local_batch=..., "
            f"max_micro_batches=...) where a worker's share must run in several passes")


def _hetero_loader(dataloader: DataLoader[Any], world_size: int) -> HeteroDataLoader:
    """A HeteroDataLoader over ``dataloader``'s dataset: the same per-rank batch times the
    world size in total, the same shuffling (and seed), collate, workers and pinning."""
    if dataloader.batch_size is None:
        raise ValueError("CannikinStrategy needs the training DataLoader's batch_size (a "
                         "batch_sampler cannot be split unevenly)")
    sampler = dataloader.sampler
    shuffle = isinstance(sampler, RandomSampler) or (
        isinstance(sampler, DistributedSampler) and sampler.shuffle)
    seed = sampler.seed if isinstance(sampler, DistributedSampler) else 0
    return HeteroDataLoader(dataloader.dataset, batch_size=dataloader.batch_size * world_size,
                            shuffle=shuffle, seed=seed, drop_last=dataloader.drop_last,
                            collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                            pin_memory=dataloader.pin_memory)
