"""The out-of-memory placeholder keeps the types of a model's outputs (a Hugging Face
``ModelOutput``, a named tuple), so ``out.loss`` still works on the retried step."""

from typing import NamedTuple

import torch

from cannikin.runtime.batches import map_batched
from hf_like import ModelOutputLike


class Pair(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor


def _first(t: torch.Tensor) -> torch.Tensor:
    return t[:1]


def test_a_model_output_stays_one() -> None:
    out = ModelOutputLike(loss=torch.tensor(2.0), logits=torch.ones(4, 3))
    mapped = map_batched(out, _first)
    assert type(mapped) is ModelOutputLike
    assert mapped.logits.shape == (1, 3)
    assert mapped.loss is out.loss  # a 0-dim loss passes through
    assert out.logits.shape == (4, 3)  # the model's own output is left alone


def test_a_named_tuple_stays_one() -> None:
    mapped = map_batched(Pair(torch.ones(4, 3), torch.tensor(1.0)), _first)
    assert type(mapped) is Pair
    assert mapped.logits.shape == (1, 3)


def test_nested_plain_containers() -> None:
    mapped = map_batched({"a": [torch.ones(3, 2), (torch.ones(5),)]}, _first)
    assert type(mapped) is dict and type(mapped["a"]) is list
    assert mapped["a"][0].shape == (1, 2) and mapped["a"][1][0].shape == (1,)
