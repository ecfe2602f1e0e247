"""Clocks: wall time on CPU; on GPU, CUDA events that time the device's work, not the launch."""

from __future__ import annotations

import time

import pytest
import torch

from cannikin.runtime.timing import CpuClock, CudaClock, clock_for, elapsed_all


def test_cpu_clock_times_host_work() -> None:
    clock = clock_for(torch.device("cpu"))
    assert isinstance(clock, CpuClock)
    start = clock.mark()
    time.sleep(0.02)
    middle = clock.mark()
    time.sleep(0.02)
    first, second = elapsed_all(clock, start, [middle, clock.mark()])
    assert 0.02 <= first < second and second >= 0.04


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_clock_times_the_device_not_the_launch() -> None:
    device = torch.device("cuda", 0)
    clock = clock_for(device)
    assert isinstance(clock, CudaClock)
    a = torch.randn(8192, 8192, device=device) / 91.0  # |a @ a| stays ~|a|
    b = a @ a  # warm-up: cuBLAS handles, kernels and the allocator's blocks
    torch.cuda.synchronize(device)
    wall_start = time.perf_counter()
    start = clock.mark()
    for _ in range(20):  # ~1.1 TFLOP each: the device's work dwarfs 20 launches
        torch.mm(a, a, out=b)
    end = clock.mark()
    launched_s = time.perf_counter() - wall_start
    gpu_s = clock.elapsed(start, end)  # waits for `end`
    wall_s = time.perf_counter() - wall_start
    # the launches return long before the device finishes; the events time the device
    assert launched_s < 0.5 * gpu_s, (launched_s, gpu_s)
    assert 0.5 * wall_s < gpu_s <= wall_s, (gpu_s, wall_s)
