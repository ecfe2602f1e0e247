"""Worker for tests/test_finisher_threads.py (one process, world 1, plain python, no
OMP_NUM_THREADS): the OpenMP thread count the all-reduce finisher thread computes with.

torch.get_num_threads() cannot show it: it applies torch's setting to the thread that asks.
A BLAS call (the norms' dot products) reads OpenMP's own per-thread count, so this asks
the OpenMP runtime that torch loaded. Prints ``fresh N`` (what a new thread starts with
here; ``fresh none`` without an OpenMP runtime) and ``finisher N ...``, one count per
reduction the finisher thread completed.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import cannikin.runtime.comm as comm
from cannikin.runtime.distributed import destroy_distributed, init_distributed
from cannikin.runtime.loader import HeteroDataLoader
from cannikin.runtime.parallel import NORM_STRIDE, HeteroDataParallel


def _openmp_threads() -> Callable[[], int] | None:
    """The loaded OpenMP runtime's ``omp_get_max_threads`` (the calling thread's count)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith(("libgomp", "libiomp", "libomp")):
            lib = ctypes.CDLL(path)  # the library already loaded: the same handle
            return lambda: int(lib.omp_get_max_threads())
    return None


def _count_of_a_new_thread(count: Callable[[], int]) -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(count()))
    thread.start()
    thread.join()
    return seen[0]


def main() -> int:
    torch.set_num_threads(1)
    count = _openmp_threads()
    if count is None:
        print("fresh none", flush=True)
        return 0
    print(f"fresh {_count_of_a_new_thread(count)}", flush=True)
    finished_with: list[int] = []
    finish = comm._finish

    def recording_finish(state: comm.CommState, reduction: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            finished_with.append(count())
        finish(state, reduction)  # type: ignore[arg-type]

    comm._finish = recording_finish  # type: ignore[assignment]
    init_distributed("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
    loader = HeteroDataLoader(data, batch_size=16, seed=0)
    model = HeteroDataParallel(net, opt, loader, slowdown=None)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step > NORM_STRIDE:
            break
    model.remove_hooks()
    destroy_distributed()
    print("finisher " + " ".join(map(str, finished_with)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
