"""Worker for tests/test_hang.py: HeteroDataParallel training where the last rank stops
responding at step ``--hang-step``; the others must fail at the collective timeout (``--timeout``),
naming their rank, instead of waiting forever. With ``--idle`` the hung rank has no samples,
so that its peers wait for it in the idle route's broadcast (cannikin.runtime.routes). With
``--skip-nonfinite continue`` no rank hangs: the script skips a step whose local loss is not
finite, as some do, and the last rank, given no samples, has a NaN loss every step; with
``--skip-nonfinite step`` it skips the backward and still takes the optimizer step."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.log import setup_logging
from cannikin.runtime import HeteroDataLoader, HeteroDataParallel, init_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--hang-step", type=int, default=3)
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--skip-nonfinite", choices=("continue", "step"))
    parser.add_argument("--samples", type=int, default=200,
                        help="20 makes the first step its epoch's last")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=args.timeout)
    setup_logging(ctx.rank)
    data = TensorDataset(torch.randn(args.samples, 4), torch.zeros(args.samples,
                                                                   dtype=torch.long))
    net = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = HeteroDataLoader(data, batch_size=20)
    model = HeteroDataParallel(net, optimizer, loader)
    if args.idle or args.skip_nonfinite:
        model.pin_split([20] + [0] * (ctx.world_size - 1))
    for x, y in loader:
        hangs = not args.skip_nonfinite and model.step == args.hang_step
        if hangs and ctx.rank == ctx.world_size - 1:
            print(f"rank {ctx.rank} stops responding", flush=True)
            time.sleep(3600)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if args.skip_nonfinite and not torch.isfinite(loss):
            if args.skip_nonfinite == "step":
                optimizer.step()
            continue
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
