"""Worker for tests/test_distributed.py: one all-reduce through init_distributed.

--mode ok          every rank all-reduces rank+1 and prints the sum
--mode hang        the last rank never joins; the others must fail within --timeout
--mode crash-once  rank 1 dies after the first all-reduce on the first run; the restarted
                   group (torchrun --max-restarts) must form again and succeed
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from cannikin.log import setup_logging
from cannikin.runtime.distributed import (
    collective_timeout_error,
    destroy_distributed,
    init_distributed,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ok", "hang", "crash-once"], default="ok")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=args.timeout)
    setup_logging(ctx.rank)
    if args.mode == "hang" and ctx.rank == ctx.world_size - 1:
        time.sleep(3600)
    value = torch.tensor([float(ctx.rank + 1)])
    try:
        dist.all_reduce(value)
    except RuntimeError as error:
        raise collective_timeout_error(ctx, "all-reduce", error) from error
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    assert value.item() == expected, (value.item(), expected)
    if args.mode == "crash-once" and ctx.restart_count == 0 and ctx.rank == 1:
        os._exit(3)
    dist.barrier()
    # "agent": torchrun's shared rendezvous store; "own": a fresh one per worker generation
    store = "agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "own"
    print(f"rank {ctx.rank} world {ctx.world_size} restart {ctx.restart_count} "
          f"sum {value.item():g} backend {ctx.backend} store {store}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
