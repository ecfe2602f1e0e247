"""The per-step exchange's encoding into a gradient bucket (runtime/comm.py), in one
process: the sum of every rank's encoded row decodes to the rows, as a float64
all-reduce would give them."""

import math

import numpy as np
import pytest
import torch

from cannikin.runtime.comm import decode_rows, encode_rows, encoded_size


def _encoded(rows: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    size = encoded_size(rows, dtype)
    assert size is not None
    out = torch.full((size,), math.inf, dtype=dtype).numpy()  # every element written
    assert encode_rows(rows, out) is out
    return out


def _rank_rows(world: int, width: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    full = rng.standard_normal((world, width)) * 10.0 ** rng.integers(-30, 31, (world, width))
    parts = []
    for rank in range(world):
        mine = np.zeros_like(full)
        mine[rank] = full[rank]
        parts.append(mine)
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", [1, 3, 16])
def test_summed_encodings_decode_to_the_rows(dtype: torch.dtype, world: int) -> None:
    parts = _rank_rows(world, 41, seed=world)
    encoded = [_encoded(p, dtype) for p in parts]
    # the sum as the all-reduce takes it: in the bucket's dtype
    summed = torch.stack([torch.from_numpy(e) for e in encoded]).sum(0)
    expected = np.sum(parts, axis=0)
    decoded = decode_rows(summed.numpy()).reshape(expected.shape)
    assert float((abs(decoded - expected) / abs(expected)).max()) < 1e-14


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_dtypes_that_cannot_carry_float64_decline(dtype: torch.dtype) -> None:
    assert encoded_size(np.ones((2, 3)), dtype) is None


def test_a_value_beyond_float32_decodes_to_nan_not_a_wrong_number() -> None:
    rows = np.array([[1e300, 2.5]])
    encoded = _encoded(rows, torch.float32)
    decoded = decode_rows(encoded)
    assert math.isnan(float(decoded[0])) and float(decoded[1]) == 2.5
