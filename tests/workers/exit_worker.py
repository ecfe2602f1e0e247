"""Many short 2-worker jobs that end right after their last collective: none may abort at exit.

The parent imports torch and Cannikin once, then forks the two workers of each job, so a
job costs its process group and a few steps rather than two interpreter start-ups. Each
worker returns to the top of this script and exits through normal interpreter
finalisation, which is where the abort happened: a backend worker thread finishing the
last gradient all-reduce dropped a Python object (a ``.then`` callback, or the
``contextvars.Context`` torch keeps in the backward's thread-local state), took the GIL
after finalisation had begun and ended in ``std::terminate`` (SIGABRT). Jobs cycle through
the ways a script can end: the loader's loop, a last backward with no ``optimizer.step()``,
a step outside the loader, and a step after ``remove_hooks()``; every other round of them
pins a split that gives rank 1 no samples, so that it receives the gradient sum from rank
0's broadcast (:mod:`cannikin.runtime.routes`) instead of an all-reduce. The workers hold
the GIL as long as a script busy in Python would, which makes the race likely.

Prints one line ``jobs J workers W aborted A`` and, for each worker that died, the job,
its ending and the signal.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.distributed import free_port

ENDINGS = ("loop", "backward_only", "outside_loader", "after_remove_hooks")


def train(rank: int, port: int, ending: str, idle: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(48, 16), torch.randint(0, 4, (48,)))
    loader = HeteroDataLoader(data, batch_size=16, seed=0)
    model = HeteroDataParallel(net, optimizer, loader)
    if idle:
        model.pin_split([16, 0])
    # the main thread keeps the GIL for up to 5 s instead of 5 ms, as a script busy in Python
    # would: a backend thread that needs it at the end is then still waiting at exit
    sys.setswitchinterval(5.0)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    if ending == "after_remove_hooks":
        model.remove_hooks()
    if ending != "loop":
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if ending != "backward_only":
            optimizer.step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warm = nn.Linear(2, 2)  # the first optimizer step imports torch._dynamo: do it once here
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    died = []
    for job in range(args.jobs):
        ending = ENDINGS[job % len(ENDINGS)]
        idle = job // len(ENDINGS) % 2 == 1
        port = free_port()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                train(rank, port, ending, idle)
                return -1  # a worker: exit through interpreter finalisation
            pids.append(pid)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            name = f"job {job} ({ending}, rank 1 idle: {idle})"
            if os.WIFSIGNALED(status):
                died.append(f"{name}: {signal.Signals(os.WTERMSIG(status)).name}")
            elif os.WEXITSTATUS(status) != 0:
                died.append(f"{name}: exit status {os.WEXITSTATUS(status)}")
    print(f"jobs {args.jobs} workers {2 * args.jobs} aborted {len(died)}", flush=True)
    for line in died:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if code >= 0:
        sys.exit(code)
