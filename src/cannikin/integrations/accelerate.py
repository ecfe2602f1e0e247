"""Hugging Face Accelerate: ``CannikinAccelerator`` in place of ``Accelerator``, and the
training data as a :class:`~cannikin.runtime.HeteroDataLoader`::

    accelerator = CannikinAccelerator(cpu=True)              # was: Accelerator(cpu=True)
    loader = HeteroDataLoader(dataset, batch_size=64)        # was: DataLoader(dataset, 32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

``prepare`` wraps the model in :class:`~cannikin.runtime.HeteroDataParallel` instead of
DistributedDataParallel and attaches it to the optimizer and the loader prepared with it
(Accelerate leaves a HeteroDataLoader as it is: it is not a DataLoader to shard). The loop is
Accelerate's: ``accelerator.backward(loss)``, ``optimizer.step()`` (the wrapped optimizer
steps the inner one after the backward, where Cannikin measures the step);
``accelerator.backward`` is the prepared model's :meth:`HeteroDataParallel.backward`, which
recovers from a CUDA out-of-memory in it. Evaluation
DataLoaders are sharded by Accelerate as usual. ``unwrap_model`` gives the user's module;
``save_state``/``load_state`` keep Cannikin's state beside Accelerate's, as JSON (plain
numbers: loading it runs no code). Where Accelerate assumes every rank holds the same
number of samples, it is adapted: a prepared LR scheduler steps once per optimizer step
(the loader's ``batch_size`` is the total, as with Accelerate's ``split_batches=True``;
by default Accelerate steps it once per process, so that a schedule sized by the length
of a per-rank DataLoader ends with the training: sized by ``len(loader)`` here, it ended
after ``1/num_processes`` of it); ``gather`` and ``gather_for_metrics`` take tensors whose
first dimension differs between ranks (the local batches), where Accelerate's would abort
the job in the collective; ``reduce(x, "mean")`` during a training step (between the
loader handing out the batch and ``optimizer.step()``) weighs each rank's value by its
share ``b_i / B``, so a per-rank mean over the local batch reduces to the step's mean.
Refused by name: ``gradient_accumulation_steps`` > 1
(use ``max_micro_batches`` and ``loader.steps()``), mixed precision through Accelerate,
and distributed types other than plain data parallelism (DeepSpeed, FSDP, ...).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, recursively_apply
from torch import nn

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.parallel import MetricsSink

STATE_FILE = "cannikin_state.json"
_DATA_PARALLEL = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class CannikinAccelerator(Accelerator):
    """Accelerate's Accelerator, preparing models as HeteroDataParallel.

    ``split``, ``lr_scaling``, ``replan_every``, ``max_local_batch``,
    ``max_micro_batches``, ``recover_backward_oom``, ``allow_idle``, ``hook_free`` and
    ``metrics`` go to :class:`HeteroDataParallel`; the rest to :class:`accelerate.Accelerator`.
    """

    def __init__(self, *args: Any, split: str = "optimal", lr_scaling: str = "auto",
                 replan_every: int = 5,
                 max_local_batch: int | Sequence[int | None] | None = None,
                 max_micro_batches: int = 1, metrics: MetricsSink | None = None,
                 recover_backward_oom: bool | None = None, allow_idle: bool = True,
                 hook_free: bool = True, **kwargs: Any) -> None:
        steps = kwargs.get("gradient_accumulation_steps", 1)
        if steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={steps}: each of Cannikin's steps weighs its "
                f"local batches by their own b_i / B, which accumulating over steps would mix "
                f"up. Raise the loader's batch_size, with max_local_batch= and "
                f"max_micro_batches= where a worker's share must run in several passes")
        super().__init__(*args, **kwargs)
        if self.mixed_precision != "no":
            raise ValueError(f"mixed_precision={self.mixed_precision!r} through Accelerate is "
                             f"not supported by CannikinAccelerator: use torch.autocast and "
                             f"torch.amp.GradScaler in the loop, as with HeteroDataParallel")
        if self.distributed_type not in _DATA_PARALLEL:
            raise ValueError(f"CannikinAccelerator runs plain data parallelism, not "
                             f"{self.distributed_type}")
        self._hdp_options: dict[str, Any] = {
            "split": split, "lr_scaling": lr_scaling, "replan_every": replan_every,
            "max_local_batch": max_local_batch, "max_micro_batches": max_micro_batches,
            "metrics": metrics, "recover_backward_oom": recover_backward_oom,
            "allow_idle": allow_idle, "hook_free": hook_free}

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """The model on this process's device, wrapped in HeteroDataParallel (for
        evaluation only: as Accelerate prepares it)."""
        if evaluation_mode or isinstance(model, HeteroDataParallel):
            plain: nn.Module = super().prepare_model(model, device_placement, evaluation_mode)
            return plain
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement:
            model = model.to(self.device)
        wrapped = HeteroDataParallel(model, **self._hdp_options)
        self._models.append(wrapped)
        return wrapped

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Accelerate's prepare, then every HeteroDataParallel prepared here attached to the
        one optimizer and the one HeteroDataLoader passed with it."""
        prepared = super().prepare(*args, device_placement=device_placement)
        items = prepared if isinstance(prepared, tuple) else (prepared,)
        models = [m for m in items if isinstance(m, HeteroDataParallel) and m._parts is None]
        if not models:
            return prepared
        optimizers = [o for o in items if isinstance(o, torch.optim.Optimizer)]
        loaders = [d for d in items if isinstance(d, HeteroDataLoader)]
        if len(models) != 1 or len(optimizers) != 1 or len(loaders) != 1:
            raise ValueError(
                f"prepare the model with its optimizer and its training data as a "
                f"HeteroDataLoader, one each, in one call: got {len(models)} model(s), "
                f"{len(optimizers)} optimizer(s) and {len(loaders)} HeteroDataLoader(s)")
        optimizer = getattr(optimizers[0], "optimizer", optimizers[0])
        models[0].attach(optimizer, loaders[0])
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Accelerate's scheduler wrapper, stepped once per optimizer step: a step here is
        one of the loader's, of its whole ``batch_size`` (Accelerate's ``split_batches``
        semantics), not one per-rank batch on each of ``num_processes`` ranks."""
        prepared = super().prepare_scheduler(scheduler)
        prepared.split_batches = True
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Through the prepared model's :meth:`HeteroDataParallel.backward` (its weight
        b_i / B in the backward's seed, one pass over the gradients less; a CUDA
        out-of-memory in it redoes the step with a smaller batch on that worker) where one
        prepared model's step is in progress (or exactly one model is prepared);
        Accelerate's otherwise. Accelerate's own would divide by
        ``gradient_accumulation_steps`` and scale for mixed precision, both refused here."""
        models = self._attached()
        stepping = [m for m in models if m.step_share is not None]
        models = stepping if stepping else models
        if len(models) != 1 or kwargs.get("learning_rate") is not None:
            super().backward(loss, **kwargs)
            return
        models[0].backward(loss, **kwargs)

    def gather(self, tensor: Any) -> Any:
        """Accelerate's gather where the ranks' tensors may differ in their first dimension
        (each rank's local batch): every rank's rows, in rank order. One more small
        collective first, for the sizes."""
        leaves: list[torch.Tensor] = []
        recursively_apply(leaves.append, tensor)
        if not leaves or self.num_processes == 1:
            return super().gather(tensor)
        local = torch.tensor([t.shape[0] if t.dim() else 1 for t in leaves], device=self.device)
        sizes = super().gather(local).reshape(self.num_processes, len(leaves))
        if bool((sizes == sizes[0]).all()):
            return super().gather(tensor)
        columns = iter(sizes.T.tolist())
        plain_gather = super().gather

        def gather_rows(t: torch.Tensor) -> torch.Tensor:
            counts = next(columns)
            if t.dim() == 0:
                return plain_gather(t)  # type: ignore[no-any-return]
            longest = max(counts)
            padded = torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))])
            chunks = plain_gather(padded).split(longest)
            return torch.cat([chunk[:n] for chunk, n in zip(chunks, counts, strict=True)])

        return recursively_apply(gather_rows, tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Accelerate's reduce; a ``"mean"`` during a training step weighs each rank's value
        by its share ``b_i / B`` of the step (DDP's plain mean, with its equal local batches,
        is the same weighing). A rank with no samples sends zeros: its mean loss is NaN
        (the mean of nothing), which times 0 made every rank's mean NaN."""
        shares = [m.step_share for m in self._attached()]
        share = next((s for s in shares if s is not None), None)
        if reduction == "mean" and share is not None:
            weight = share * self.num_processes
            tensor = recursively_apply(
                lambda t: t * weight if weight else torch.zeros_like(t), tensor)
        return super().reduce(tensor, reduction, scale)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        if isinstance(model, HeteroDataParallel):
            return model.module
        result: nn.Module = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        return result

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """Accelerate's state, then Cannikin's (fitted models, noise scale, total batch,
        step, the loader's position) as JSON in the same folder."""
        location = str(super().save_state(output_dir, safe_serialization,
                                          **save_model_func_kwargs))
        if self.is_main_process:
            states = [{"runtime": m.runtime_state_dict(), "loader": m.loader.state_dict()}
                      for m in self._attached()]
            (Path(location) / STATE_FILE).write_text(json.dumps(states), "utf-8")
        self.wait_for_everyone()  # every rank may load it from here on
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        if input_dir is None:
            raise ValueError("CannikinAccelerator.load_state needs the folder save_state "
                             "returned (input_dir=...)")
        super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        path = Path(input_dir) / STATE_FILE
        states = json.loads(path.read_text("utf-8"))
        models = self._attached()
        if len(states) != len(models):
            raise ValueError(f"{path} holds {len(states)} Cannikin states for "
                             f"{len(models)} prepared models")
        for model, state in zip(models, states, strict=True):
            model.load_runtime_state_dict(state["runtime"])
            model.loader.load_state_dict(state["loader"])

    def _attached(self) -> list[HeteroDataParallel]:
        return [m for m in self._models if isinstance(m, HeteroDataParallel) and m._parts]
