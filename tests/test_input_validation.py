"""Bad input at the API boundary (HeteroDataLoader, autoscale_batch_size,
HeteroDataParallel) fails at once with an error that names the value (a world of 1)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.distributed import destroy_distributed, init_distributed

DATA = TensorDataset(torch.randn(20, 3), torch.zeros(20, dtype=torch.long))


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    init_distributed(env={})
    yield
    destroy_distributed()


def wrap(loader: HeteroDataLoader | None = None, optimizer: Any = None,
         **kwargs: Any) -> HeteroDataParallel:
    net = nn.Linear(3, 2)
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=0.1)
    return HeteroDataParallel(net, optimizer, loader or HeteroDataLoader(DATA, batch_size=8),
                              **kwargs)


def autoscaled(max_batch_size: int, bounds: tuple[int, int | None]) -> HeteroDataLoader:
    loader = HeteroDataLoader(DATA, batch_size=8)
    loader.autoscale_batch_size(max_batch_size, local_bsz_bounds=bounds)
    return loader


def no_param_groups() -> HeteroDataParallel:
    net = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    optimizer.param_groups.clear()
    return wrap(optimizer=optimizer)


def autoscale_after_wrapping() -> None:
    wrap().loader.autoscale_batch_size(16)


def two_models_one_loader() -> None:
    loader = HeteroDataLoader(DATA, batch_size=8)
    wrap(loader)
    wrap(loader)  # a GAN's generator on the discriminator's loader


def a_loader_passed_on() -> HeteroDataParallel:
    """A model whose hooks were removed hands its loader on (a rebuilt model)."""
    loader = HeteroDataLoader(DATA, batch_size=8)
    wrap(loader).remove_hooks()
    return wrap(loader)


CASES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("batch size 0", lambda: HeteroDataLoader(DATA, batch_size=0), ValueError,
     "batch_size must be an integer >= 1, got 0"),
    ("fractional batch size", lambda: HeteroDataLoader(DATA, batch_size=2.5),  # type: ignore
     ValueError, "got 2.5"),
    ("bool batch size", lambda: HeteroDataLoader(DATA, batch_size=True), ValueError,
     "got True"),
    ("dataset smaller than one batch", lambda: HeteroDataLoader(DATA, batch_size=32),
     ValueError, r"dataset of 20 samples is smaller than one batch \(batch_size=32\)"),
    ("... also with drop_last", lambda: HeteroDataLoader(DATA, batch_size=32, drop_last=True),
     ValueError, "dataset of 20 samples"),
    ("rank outside the world", lambda: HeteroDataLoader(DATA, batch_size=8, rank=2),
     ValueError, r"rank 2 is not a worker of a world of 1: expected 0 <= rank < 1"),
    ("empty dataset", lambda: HeteroDataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=1),
     ValueError, "dataset of 0 samples"),
    ("max_batch_size < batch_size", lambda: autoscaled(4, (1, None)), ValueError,
     r"max_batch_size must be an integer >= batch_size \(8\), got 4"),
    ("bounds lo > hi", lambda: autoscaled(16, (5, 2)), ValueError,
     r"local_bsz_bounds .* got \(5, 2\)"),
    ("bounds lo < 1", lambda: autoscaled(16, (0, None)), ValueError, r"got \(0, None\)"),
    ("bounds that cannot hold B", lambda: wrap(autoscaled(16, (1, 4))), ValueError,
     r"batch_size 8 does not fit the local caps \[4\]"),
    ("lo x workers > B", lambda: wrap(autoscaled(16, (9, None))), ValueError,
     "local_bsz_bounds lo=9 times 1 workers exceeds batch_size 8"),
    ("memory cap below B", lambda: wrap(max_local_batch=4), ValueError,
     r"batch_size 8 does not fit the local caps \[4\]"),
    ("memory cap 0", lambda: wrap(max_local_batch=0), ValueError,
     "max_local_batch must be an integer >= 1 or None, got 0"),
    ("caps of another world size", lambda: wrap(max_local_batch=[8, 8]), ValueError,
     r"max_local_batch has 2 entries, expected one per worker \(1\)"),
    ("optimizer without param groups", no_param_groups, ValueError,
     "the optimizer has no param groups"),
    ("unknown split", lambda: wrap(split="fast"), ValueError,
     r"split must be one of \('optimal', 'even', 'adaptdl'\), got 'fast'"),
    ("unknown LR rule", lambda: wrap(lr_scaling="cubic"), ValueError, "'cubic'"),
    ("replan_every 0", lambda: wrap(replan_every=0), ValueError,
     "replan_every must be >= 1, got 0"),
    ("autoscale after wrapping", autoscale_after_wrapping, RuntimeError,
     "must be called before the model is wrapped"),
    ("two models on one loader", two_models_one_loader, ValueError,
     "hands its steps to another HeteroDataParallel already"),
]


@pytest.mark.parametrize(("build", "error", "match"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_named(build: Callable[[], object], error: type[Exception],
                            match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_valid_edges_are_accepted() -> None:
    """The boundaries themselves are valid: B equal to the dataset, caps summing to B."""
    model = wrap(HeteroDataLoader(DATA, batch_size=20), max_local_batch=20)
    assert model.plan.local_batches == (20,)
    model = wrap(autoscaled(8, (8, 8)))
    assert model.total_batch == 8
    model = a_loader_passed_on()
    assert model.drives and model.loader.controller is model


def test_a_cpu_model_under_nccl_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="the process group is nccl, which reduces CUDA "
                                         "tensors only, but the model is on cpu"):
        wrap()


def test_lr_scaling_defaults_to_what_a_ddp_user_expects() -> None:
    # a fixed total batch keeps the LR, as DDP does (a final partial batch included); a
    # goodput-chosen one scales it, by AdaScale, or its Adam variant for Adam
    assert wrap().scaler.rule == "none"
    assert wrap(autoscaled(32, (1, None))).scaler.rule == "adascale"
    net = nn.Linear(3, 2)
    adam = torch.optim.AdamW(net.parameters(), lr=1e-3)
    assert HeteroDataParallel(net, adam, autoscaled(32, (1, None))).scaler.rule == "adamscale"
    assert wrap(lr_scaling="adascale").scaler.rule == "adascale"  # an explicit rule wins


def test_parameters_outside_an_lr_scaled_optimizer_are_said(
        caplog: pytest.LogCaptureFixture) -> None:
    """A second optimizer's parameters keep their LR while the attached one's scales with
    the total batch: said once at attach, naming them; not at a fixed batch without a rule
    (nothing is scaled), nor where the attached optimizer holds every parameter."""
    def attach(params: str, loader: HeteroDataLoader, lr_scaling: str = "auto") -> list[str]:
        caplog.clear()
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        trained = net[0].parameters() if params == "first" else net.parameters()
        with caplog.at_level("WARNING", logger="cannikin.runtime.parallel"):
            HeteroDataParallel(net, torch.optim.SGD(trained, lr=0.1), loader,
                               lr_scaling=lr_scaling).remove_hooks()
        return [r.getMessage() for r in caplog.records if "not in the optimizer" in r.message]

    said = attach("first", autoscaled(32, (1, None)))
    assert len(said) == 1 and "2 trained parameters of the model (1.weight, 1.bias)" in said[0]
    assert "lr_scaling='adascale'" in said[0]
    assert len(attach("first", HeteroDataLoader(DATA, batch_size=8), "linear")) == 1
    assert attach("first", HeteroDataLoader(DATA, batch_size=8)) == []  # "none": no scaling
    assert attach("all", autoscaled(32, (1, None))) == []

