"""A batch's tensors replaced, its containers kept: for the empty batch of an idle worker
and for the out-of-memory placeholder's inputs and outputs."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def map_batched(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor with a batch dimension in a nested value; 0-dim
    tensors (a loss, a scalar argument) and anything else pass through. Containers keep
    their type: a named tuple stays one, and a mapping (a Hugging Face ``ModelOutput``, a
    tokenizer's ``BatchEncoding``) is copied and its entries replaced."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.dim() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_batched(v, fn) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(map_batched(v, fn) for v in value)
    if isinstance(value, MutableMapping):
        mapped = copy.copy(value)
        for key, item in value.items():
            mapped[key] = map_batched(item, fn)
        return mapped
    if isinstance(value, Mapping):
        return {key: map_batched(item, fn) for key, item in value.items()}
    return value
