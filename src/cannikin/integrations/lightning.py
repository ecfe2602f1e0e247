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

``Trainer(accumulate_grad_batches=k)`` with ``DataLoader(batch_size=b)`` is DDP's step of
``k * b * world`` samples: here that is the total batch of every optimizer step, split by
the plan, each worker's share run as exactly ``k`` micro-batches
(``HeteroDataParallel(micro_batches=k)``), so that every rank runs the training step, and
the collectives in it, ``k`` times per optimizer step, as Lightning's loop expects; the
gradient is the mean over the step's samples (Lightning's division of each loss by ``k``
is undone: Cannikin weighs the passes by their sizes). ``CannikinStrategy(max_local_batch=)``
then bounds each micro-batch. A goodput-chosen total batch changes the number of steps of
an epoch: after each step the strategy sets Lightning's count of the epoch's batches (and
``limit_train_batches``, the validation interval and the progress bar's total) to the
loader's (:meth:`CannikinStrategy.on_train_batch_start`), so an epoch ends where the
loader's does.

Refused, by name: manual optimization (and so several optimizers, which Lightning allows
only there) and ``max_micro_batches`` (each worker its own number of passes, which
Lightning's loop cannot follow: use ``accumulate_grad_batches``).
``self.log(..., sync_dist=True)`` during a training step averages the ranks' local means
weighted by their shares ``b_i / B`` of the step (of the micro-batch, with
``accumulate_grad_batches``; :meth:`CannikinStrategy.reduce`), so a logged loss is the
step's mean loss (DDP's unweighted average of the ranks' means is not, at an uneven
split); an ``on_epoch`` value is weighted by batch size, as Lightning does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.parallel import MetricsSink

_STATE_KEY = "cannikin"


class CannikinStrategy(DDPStrategy):
    """Lightning's DDP with Cannikin's planned split, exact mean gradient and measurements.

    ``split``, ``lr_scaling``, ``replan_every``, ``max_local_batch`` (the most samples of
    one forward and backward: of a micro-batch with ``accumulate_grad_batches``),
    ``metrics``, ``allow_idle`` and ``hook_free`` go to :class:`HeteroDataParallel`;
    ``max_batch_size`` (with ``local_bsz_bounds``) lets the total batch of a step grow by goodput
    (:meth:`HeteroDataLoader.autoscale_batch_size`). ``max_micro_batches`` above 1 is
    refused (use ``Trainer(accumulate_grad_batches=)``). Other keyword arguments are DDP's.
    """

    strategy_name = "cannikin"

    def __init__(self, *, split: str = "optimal", lr_scaling: str = "auto",
                 replan_every: int = 5, max_local_batch: int | Sequence[int | None] | None = None,
                 max_micro_batches: int = 1, max_batch_size: int | None = None,
                 local_bsz_bounds: tuple[int, int | None] | None = None,
                 metrics: MetricsSink | None = None, allow_idle: bool = True,
                 hook_free: bool = True, **ddp_kwargs: Any) -> None:
        if max_micro_batches != 1:
            raise ValueError(
                f"CannikinStrategy(max_micro_batches={max_micro_batches!r}): it gives each "
                f"worker its own number of passes, but Lightning runs the training step the "
                f"same number of times on every rank between two optimizer steps. Use "
                f"Trainer(accumulate_grad_batches=k): every worker runs each step in k "
                f"micro-batches, each of at most max_local_batch samples; "
                f"max_micro_batches must be 1")
        super().__init__(**ddp_kwargs)
        self._hdp_options: dict[str, Any] = {
            "split": split, "lr_scaling": lr_scaling, "replan_every": replan_every,
            "max_local_batch": max_local_batch, "metrics": metrics, "allow_idle": allow_idle,
            "hook_free": hook_free}
        self._autoscale = (max_batch_size, local_bsz_bounds)
        self._restored: dict[str, Any] | None = None
        self._wrapped: HeteroDataParallel | None = None
        """The wrapper of the last fit, kept past its teardown (a checkpoint saved after
        ``fit()`` still carries its state)."""
        self._passes = 1
        """Micro-batches per step: the Trainer's ``accumulate_grad_batches``."""
        self._served: HeteroDataLoader | _MicroBatches | None = None
        """The training loader as Lightning iterates it."""

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        _refuse_unsupported(trainer)
        self._passes = trainer.accumulate_grad_batches
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> HeteroDataParallel:  # type: ignore[override]
        """HeteroDataParallel instead of DistributedDataParallel (attached to the optimizer
        and the loader once both exist, :meth:`process_dataloader`), every step in
        ``accumulate_grad_batches`` micro-batches."""
        passes = self._passes if self._passes > 1 else None
        self._wrapped = HeteroDataParallel(model, **self._hdp_options, micro_batches=passes,
                                           **self._ddp_kwargs)
        return self._wrapped

    def _register_ddp_hooks(self) -> None:
        """Nothing: HeteroDataParallel's own all-reduce hook is the one that must run."""

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader, as a HeteroDataLoader over its dataset (attached to the
        model and the optimizer) whose total batch is DDP's step, ``batch_size x world size
        x accumulate_grad_batches``, served one micro-batch at a time when there are
        several; any other loader as it is."""
        model = self.model
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (not isinstance(model, HeteroDataParallel) or model._parts is not None
                or trainer is None or not trainer.training or not self.optimizers):
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(f"CannikinStrategy needs the training data as a torch DataLoader "
                            f"(to give each worker its share of every batch), got "
                            f"{type(dataloader).__name__}")
        loader = _hetero_loader(dataloader, self.world_size * self._passes)
        max_batch, bounds = self._autoscale
        if max_batch is not None:
            loader.autoscale_batch_size(max_batch, local_bsz_bounds=bounds)
        optimizer = self.optimizers[0]
        model.attach(getattr(optimizer, "_optimizer", optimizer), loader)
        if self._restored is not None:
            model.load_runtime_state_dict(self._restored["runtime"])
            loader.load_state_dict(self._restored["loader"])
            self._restored = None
        self._served = loader if self._passes == 1 else _MicroBatches(loader, model)
        return self._served

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Refuse a change of ``accumulate_grad_batches`` since ``fit()`` (a
        GradientAccumulationScheduler's), and set Lightning's count of the epoch's batches
        to the loader's (:meth:`_follow_epoch_length`)."""
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or self._served is None:
            return
        if trainer.accumulate_grad_batches != self._passes:
            raise RuntimeError(
                f"accumulate_grad_batches changed from {self._passes} to "
                f"{trainer.accumulate_grad_batches} during fit() (a "
                f"GradientAccumulationScheduler?): CannikinStrategy splits every step into "
                f"the micro-batches fixed at fit(), so a different count would end Lightning's "
                f"optimizer steps inside its steps. Keep accumulate_grad_batches fixed (a "
                f"larger total batch comes from CannikinStrategy(max_batch_size=...))")
        self._follow_epoch_length(trainer)

    def _follow_epoch_length(self, trainer: pl.Trainer) -> None:
        """Lightning counts the epoch's batches once, at its start (``num_training_batches``,
        where its batch fetcher says the epoch ends, ``limit_train_batches``, the validation
        interval, the progress bar's total). A goodput-chosen total batch changes the number
        of steps at a re-plan: a stale count ended an epoch before the loader's (whose
        samples Lightning's next ``set_epoch`` then skipped) or after it (at a
        StopIteration, with the epoch's last batch not known as such: epoch-interval LR
        schedulers did not step). Set them all to the loader's count of this epoch."""
        served = self._served
        fit_loop = trainer.fit_loop
        fetcher = fit_loop._data_fetcher
        if served is None or fetcher is None or not trainer.training:
            return
        combined = fetcher.combined_loader
        if not any(loader is served for loader in combined.flattened):
            return
        count = _limited(_epoch_batches(served), trainer.limit_train_batches, self._passes)
        limits = combined.limits
        if limits is not None:  # in place: the epoch's iterator holds this very list
            for i, loader in enumerate(combined.flattened):
                if loader is served:
                    limits[i] = count
        fit_loop.max_batches = count
        fetcher.length = count
        fetcher.done = fetcher.fetched >= count
        fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
        interval = trainer.val_check_interval
        if isinstance(interval, float) and trainer.val_check_batch not in (None, math.inf):
            trainer.val_check_batch = max(1, int(count * interval))
        _follow_progress_bar(trainer)

    # -- the step --------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | nn.Module | None = None,
                       **kwargs: Any) -> Any:
        """Lightning's closure (training step, backward) first, then the step, whose closure
        hands back the result: the pre-hook that measures the step runs after the backward."""
        result = closure()
        stepped = super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        if self.lightning_module is not None:  # the step's re-plan may change the count
            self._follow_epoch_length(self.lightning_module.trainer)
        return stepped

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: HeteroDataParallel all-reduces after the last micro-batch of a
        step only (its ``begin_pass``), which ends Lightning's accumulation window (its
        ``no_sync()`` refuses, as it would weigh several steps by one step's shares)."""
        yield None

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any,
                 **kwargs: Any) -> Tensor:
        """Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` (the mean
        of k equal batches); the passes here are weighed by their sizes (the rescale
        between passes and the all-reduce's ``b_i / B``), so the loss goes back whole. A
        step of one pass carries its weight ``b_i / B`` in the loss, so the all-reduce hook
        need not scale the gradients (:meth:`HeteroDataParallel.weighted_backward`)."""
        if self._passes > 1:
            closure_loss = closure_loss * self._passes
        if self._wrapped is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with self._wrapped.weighted_backward() as weight:
            weighted = closure_loss if weight is None else closure_loss * weight
            super().backward(weighted, optimizer, *args, **kwargs)
        return closure_loss

    def reduce(self, tensor: Tensor, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Tensor:
        """DDP's reduce, except a mean over the world during a training step: the ranks'
        values weighted by their shares ``b_i / B`` (a rank with no samples counts 0, its
        mean of nothing being NaN)."""
        share = self._step_share()
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if share is None or not mean or group is not None or not isinstance(tensor, Tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        weighted = tensor * share if share > 0 else torch.zeros_like(tensor)
        dist.all_reduce(weighted)
        return weighted

    def _step_share(self) -> float | None:
        """This rank's share of the samples of the step in progress (of its micro-batch in
        progress, with several); None outside a step."""
        model = self._wrapped
        if model is None or model.step_share is None:
            return None
        served = self._served
        if isinstance(served, _MicroBatches) and served.share is not None:
            return served.share
        return model.step_share

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
        self._served = None
        super().teardown()


class _MicroBatches:
    """A HeteroDataLoader's micro-batches one after another (``loader.steps()`` flattened),
    for Lightning's loop, which counts batches: with ``micro_batches=k`` every step is k of
    them on every rank, so Lightning's optimizer step, after every k-th batch, falls after
    each step's last. The loader's state, sampler (``set_epoch``) and steps pass through."""

    def __init__(self, loader: HeteroDataLoader, model: HeteroDataParallel) -> None:
        self.loader = loader
        self.model = model
        self.passes = model.planner.config.micro_batches or 1
        self.share: float | None = None
        """This rank's share of the samples of the micro-batch in progress (its size over
        the sum of every rank's same micro-batch), for the weighted logging."""

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def __len__(self) -> int:
        return self.passes * len(self.loader)

    @property
    def epoch_steps(self) -> int:
        return self.loader.epoch_steps

    def __iter__(self) -> Iterator[Any]:
        planner, rank = self.model.planner, self.model.rank
        for step in self.loader.steps():
            split = self.loader.step_split or ()
            sizes = [planner.passes(r, b) for r, b in enumerate(split)]
            for j, batch in enumerate(step):
                together = sum(passes[j] for passes in sizes)
                self.share = sizes[rank][j] / together if together else 0.0
                yield batch
        self.share = None

    def state_dict(self) -> dict[str, int | bool]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def _epoch_batches(served: HeteroDataLoader | _MicroBatches) -> int:
    """Batches Lightning takes in the loader's epoch in progress."""
    passes = served.passes if isinstance(served, _MicroBatches) else 1
    return passes * served.epoch_steps


def _limited(batches: int, limit: int | float, passes: int) -> int:
    """``limit_train_batches`` applied to ``batches`` as Lightning does (an int caps them, a
    float keeps that fraction, at least one), in whole steps of ``passes`` micro-batches:
    a step cut short would leave its other samples out of the mean gradient."""
    if isinstance(limit, int):
        count = min(batches, limit)
    else:
        count = min(batches, max(1, int(batches * limit))) if batches else 0
    return min(batches, -(-count // passes) * passes)


def _follow_progress_bar(trainer: pl.Trainer) -> None:
    """The progress bar's total to ``trainer.num_training_batches``, which Lightning's bars
    read only at the epoch's start (TQDM's and Rich's; another bar is left alone)."""
    bar = trainer.progress_bar_callback
    if bar is None:
        return
    total = bar.total_train_batches
    if isinstance(bar, TQDMProgressBar):
        try:
            tqdm_bar = bar.train_progress_bar
        except TypeError:  # not created yet
            return
        if tqdm_bar.total != total:
            tqdm_bar.total = total
            tqdm_bar.refresh()
        return
    task, progress = getattr(bar, "train_progress_bar_id", None), getattr(bar, "progress", None)
    if task is not None and progress is not None:
        progress.update(task, total=total)


def _refuse_unsupported(trainer: pl.Trainer) -> None:
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise RuntimeError("CannikinStrategy supports automatic optimization only: with "
                           "manual optimization Lightning does not run the optimizer step "
                           "where Cannikin measures and plans it")


def _hetero_loader(dataloader: DataLoader[Any], replicas: int) -> HeteroDataLoader:
    """A HeteroDataLoader over ``dataloader``'s dataset: the same per-rank batch times
    ``replicas`` (world size x micro-batches) in total, the same shuffling (and seed),
    collate, workers, their init function and pinning; another sampler is refused."""
    if dataloader.batch_size is None:
        raise ValueError("CannikinStrategy needs the training DataLoader's batch_size (a "
                         "batch_sampler cannot be split unevenly)")
    sampler = dataloader.sampler
    if type(sampler) not in (RandomSampler, SequentialSampler, DistributedSampler):
        # Lightning's DistributedSamplerWrapper keeps the user's sampler in its dataset
        own = getattr(getattr(sampler, "dataset", None), "_sampler", sampler)
        raise ValueError(
            f"CannikinStrategy trains on a HeteroDataLoader over the DataLoader's dataset, "
            f"which draws every sample once per epoch, shuffled or in order: the "
            f"DataLoader's {type(own).__name__} (its weights, subset or order) would be "
            f"dropped. Give the DataLoader shuffle=True or False (a Subset of the dataset "
            f"for a subset)")
    shuffle = isinstance(sampler, RandomSampler) or (
        isinstance(sampler, DistributedSampler) and sampler.shuffle)
    seed = sampler.seed if isinstance(sampler, DistributedSampler) else 0
    return HeteroDataLoader(dataloader.dataset, batch_size=dataloader.batch_size * replicas,
                            shuffle=shuffle, seed=seed, drop_last=dataloader.drop_last,
                            collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                            pin_memory=dataloader.pin_memory,
                            worker_init_fn=dataloader.worker_init_fn)
