"""A re-plan's decision as the vector one rank broadcasts to the others."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cannikin.optperf import CostlyWorker
from cannikin.runtime.decision import KINDS, Decision


@st.composite
def decisions(draw: st.DrawFn) -> Decision:
    n = draw(st.integers(1, 8))
    batches = tuple(draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n)))
    times = st.floats(1e-6, 1e3, allow_nan=False)
    costly = tuple(CostlyWorker(rank=r, step_time=draw(times), without_step_time=draw(times))
                   for r in range(n) if draw(st.booleans()))
    idle = {r: draw(st.integers(0, 10**7)) for r in range(n) if draw(st.booleans())}
    return Decision(local_batches=batches, predicted_s=draw(st.none() | times),
                    kind=draw(st.sampled_from(KINDS)), rank=draw(st.integers(-1, n - 1)),
                    target=draw(st.integers(0, 10**6)), idle_until=idle, costly=costly)


@given(decisions())
def test_a_decision_comes_back_from_its_vector_unchanged(decision: Decision) -> None:
    vector = decision.to_vector()
    assert vector.shape == (Decision.size(len(decision.local_batches)),)
    assert Decision.from_vector(vector) == decision


def test_the_reason_names_what_a_split_explores() -> None:
    plan = Decision(local_batches=(5, 7), predicted_s=None)
    assert plan.reason("cadence") == "cadence"
    assert Decision(local_batches=(8, 8), predicted_s=None, kind="explore").reason(
        "cadence") == "explore total batch 16"
    assert Decision(local_batches=(9, 3), predicted_s=None, kind="probe", rank=1,
                    target=3).reason("cadence") == "probe worker 1 at local batch 3"
    assert Decision(local_batches=(12, 0), predicted_s=None, kind="try", rank=1).reason(
        "cadence") == "try worker 1 at 0 samples"


def test_malformed_decisions_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"decision kind 'guess' is not one of"):
        Decision(local_batches=(1,), predicted_s=None, kind="guess")
    with pytest.raises(ValueError, match=r"4 \+ 4 \* world_size entries, got 7"):
        Decision.from_vector(np.zeros(7))
    failed = Decision.from_vector(Decision.failed(3).to_vector())
    assert failed.kind == "failed" and failed.local_batches == (0, 0, 0)
    assert math.isnan(Decision(local_batches=(1, 2), predicted_s=None).to_vector()[3])
