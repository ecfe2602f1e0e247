"""Clocks for per-step measurements: wall time on CPU, CUDA events on GPU.

A clock hands out opaque *marks* cheaply during the step (inside autograd and
communication callbacks, where a host sync would distort what is measured) and
turns them into seconds once, when the step's measurements are collected.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Clock(Protocol):
    def mark(self) -> Any:
        """Record "now" on this clock; cheap and never synchronises."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end`` (may synchronise)."""


class CpuClock:
    """``time.perf_counter``: what the host sees, exact for CPU compute and gloo."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """CUDA events recorded on the current stream: GPU time, not launch time.

    A mark taken inside a communication future's callback lands on the stream the
    future completes on, so it times the collective itself.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        if not end.query():  # type: ignore[no-untyped-call]  # sync only if behind
            end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


def clock_for(device: torch.device) -> CpuClock | CudaClock:
    """The clock that measures work on ``device``."""
    return CudaClock(device) if device.type == "cuda" else CpuClock()


def elapsed_all(clock: Clock, start: Any, marks: Sequence[Any]) -> list[float]:
    """Seconds from ``start`` to each of ``marks``."""
    return [clock.elapsed(start, m) for m in marks]
