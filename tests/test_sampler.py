"""UnevenSampler: exactly-once coverage under changing splits, resumable state, refusals."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cannikin.runtime.sampler import STATE_VERSION, UnevenSampler, epoch_permutation


def random_split(draw: st.DrawFn, total: int) -> list[int]:
    """A split of ``total`` over 1-6 workers, zeros allowed."""
    workers = draw(st.integers(1, 6))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=workers - 1,
                                max_size=workers - 1)))
    return list(np.diff([0, *cuts, total]).astype(int))


@st.composite
def epochs(draw: st.DrawFn) -> tuple[int, int, list[list[int]]]:
    """(num_samples, seed, splits of one epoch): random B and world size at every step."""
    num_samples = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    splits, left = [], num_samples
    while left:
        total = min(draw(st.integers(1, 64)), left)
        splits.append(random_split(draw, total))
        left -= total
    return num_samples, seed, splits


def run_epoch(sampler: UnevenSampler, splits: list[list[int]]) -> list[np.ndarray]:
    """Each rank's own sampler takes its share; a change of world size restarts the ranks

    from the state of rank 0, as an elastic restart from a checkpoint would.
    """
    ranks: list[UnevenSampler] = []
    taken = []
    for split in splits:
        if len(split) != len(ranks):
            state = (ranks[0] if ranks else sampler).state_dict()
            ranks = [UnevenSampler(sampler.num_samples, seed=sampler.seed) for _ in split]
            for rank in ranks:
                rank.load_state_dict(state)
        taken += [ranks[r].take(split, r) for r in range(len(split))]
    if ranks:
        sampler.load_state_dict(ranks[0].state_dict())
    return taken


@settings(max_examples=150, deadline=None)
@given(epochs())
def test_every_index_exactly_once_in_permutation_order(case: tuple) -> None:
    num_samples, seed, splits = case
    sampler = UnevenSampler(num_samples, seed=seed)
    taken = np.concatenate(run_epoch(sampler, splits))
    assert np.array_equal(np.sort(taken), np.arange(num_samples))  # no index missed or repeated
    assert np.array_equal(taken, epoch_permutation(seed, 0, num_samples))
    assert sampler.remaining() == 0


@settings(max_examples=100, deadline=None)
@given(epochs(), st.data())
def test_resume_mid_epoch_continues_identically(case: tuple, data: st.DataObject) -> None:
    num_samples, seed, splits = case
    cut = data.draw(st.integers(0, len(splits)))
    reference = run_epoch(UnevenSampler(num_samples, seed=seed), splits)
    first = UnevenSampler(num_samples, seed=seed)
    before = run_epoch(first, splits[:cut])
    resumed = UnevenSampler(num_samples, seed=seed)
    resumed.load_state_dict(first.state_dict())
    after = run_epoch(resumed, splits[cut:])
    assert all(np.array_equal(a, b) for a, b in zip(before + after, reference, strict=True))


def test_epochs_differ_and_are_deterministic() -> None:
    sampler, other = UnevenSampler(50, seed=3), UnevenSampler(50, seed=3)
    first = sampler.take([20, 30], 1)
    assert len(other.take([20, 30], 0)) == 20
    assert sampler.remaining() == 0 == other.remaining()
    sampler.new_epoch()
    assert sampler.epoch == 1 and sampler.position == 0
    assert not np.array_equal(sampler.permutation(), epoch_permutation(3, 0, 50))
    assert np.array_equal(first, epoch_permutation(3, 0, 50)[20:50])
    assert not np.array_equal(epoch_permutation(3, 0, 50), epoch_permutation(4, 0, 50))


def test_final_partial_batch_is_split_or_dropped() -> None:
    kept = UnevenSampler(10, seed=1)
    kept.take([2, 2], 0)
    kept.take([2, 2], 0)
    assert kept.next_total(4) == 2  # the caller re-plans for the remainder of 2
    assert len(kept.take([1, 1], 1)) == 1
    assert kept.next_total(4) == 0
    dropped = UnevenSampler(10, seed=1, drop_last=True)
    dropped.take([4, 4], 0)
    assert dropped.next_total(4) == 0 and dropped.next_total(2) == 2


def test_splits_that_do_not_fit_are_refused() -> None:
    sampler = UnevenSampler(10)
    with pytest.raises(ValueError, match=r"sum to 11 but only 10 samples are left in epoch 0"):
        sampler.take([5, 6], 0)
    with pytest.raises(ValueError, match=r"local_batches\[1\] must be >= 0, got -1"):
        sampler.take([5, -1], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        sampler.take([5, 5], 2)
    with pytest.raises(ValueError, match="sum to at least 1"):
        sampler.take([0, 0], 0)
    with pytest.raises(TypeError, match="local_batches\\[0\\] must be an integer, got 2.5"):
        sampler.take([2.5], 0)
    assert sampler.position == 0  # refused calls change nothing
    sampler.take([10], 0)
    with pytest.raises(ValueError, match="epoch 0 is over; call new_epoch"):
        sampler.take([1], 0)
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        UnevenSampler(0)


def test_state_is_plain_and_versioned() -> None:
    sampler = UnevenSampler(100, seed=7)
    sampler.new_epoch()
    sampler.take([3, 4], 0)
    state = sampler.state_dict()
    assert state == {"version": STATE_VERSION, "num_samples": 100, "seed": 7, "epoch": 1,
                     "position": 7, "drop_last": False, "shuffle": True}
    assert all(type(v) in (int, bool) for v in state.values())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_samples": 99}, "num_samples is 99 but this sampler's is 100"),
        ({"seed": 8}, "seed is 8 but this sampler's is 7"),
        ({"version": 2}, "version 2 is not supported"),
        ({"position": 101}, r"position must be in \[0, 100\], got 101"),
        ({"epoch": -1}, "epoch must be >= 0, got -1"),
    ],
)
def test_state_it_cannot_honour_is_refused(change: dict, message: str) -> None:
    sampler = UnevenSampler(100, seed=7)
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict({**UnevenSampler(100, seed=7).state_dict(), **change})
    assert (sampler.epoch, sampler.position) == (0, 0)


def test_state_missing_keys_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lacks \['position'\]"):
        UnevenSampler(5).load_state_dict({"version": 1, "num_samples": 5, "seed": 0, "epoch": 0})



def test_set_epoch_keeps_the_epoch_in_progress() -> None:
    # the usual DDP loop calls set_epoch(e) before each epoch: after epoch 0 ended the
    # sampler is already at epoch 1, and a resumed epoch keeps its position
    sampler = UnevenSampler(10, seed=1)
    sampler.take([3, 2], 0)
    sampler.set_epoch(0)
    assert (sampler.epoch, sampler.position) == (0, 5)
    sampler.new_epoch()
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.position) == (1, 0)


def test_set_epoch_to_another_epoch_starts_it() -> None:
    sampler = UnevenSampler(10, seed=1)
    sampler.take([3, 2], 0)
    sampler.set_epoch(4)
    fresh = UnevenSampler(10, seed=1)
    for _ in range(4):
        fresh.new_epoch()
    assert (sampler.epoch, sampler.position) == (4, 0)
    assert sampler.permutation().tolist() == fresh.permutation().tolist()


def test_set_epoch_rejects_a_negative_epoch() -> None:
    with pytest.raises(ValueError, match="epoch"):
        UnevenSampler(10, seed=1).set_epoch(-1)
