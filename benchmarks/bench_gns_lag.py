"""How far the smoothed noise scale lags the true one on a short training run.

One process trains the demo's CNN on scikit-learn's digits (SGD, Nesterov momentum 0.9,
lr 0.05, B = 64, the demo's seed) and, every ``--every`` steps, computes the *true* noise
scale tr(Sigma) / |G|^2 of the training set at the current weights (every sample's own
gradient, ``torch.func.vmap``). Beside it, each step feeds :class:`cannikin.gns.
NoiseScaleTracker` the norms the runtime would see: the step's batch split over four workers
as Cannikin splits it for speeds 1,1,2,4 (3, 3, 16, 42). Printed per row: the held-out
accuracy, the true noise scale, the tracker's estimate at each smoothing, and the cautious
estimate the planner chooses the batch by (|G|^2 raised by ``--sigmas`` standard errors).

The noise scale changes 10x within a hundred steps here, while AdaptDL's 0.999^(B/B0)
average spans about a thousand: a mean of |G|^2 over the run is held up by the learning
phase's large values. Figures only, no asserts.

Run: ``python benchmarks/bench_gns_lag.py [--epochs 10]`` (needs the demo's packages).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from cannikin.demo.digits import save_digits_split
from cannikin.demo.model import DigitsCNN
from cannikin.gns import NoiseScaleTracker

SPLIT = [3, 3, 16, 42]
SMOOTHINGS = (0.999, 0.99, 0.9)
"""Plain averages (no restarts) beside the tracker as the planner makes it."""


def _per_sample_gradients(model: torch.nn.Module, x: torch.Tensor,
                          y: torch.Tensor) -> torch.Tensor:
    """(samples, parameters): each sample's own loss gradient, flattened."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)),
                                                 yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1)


def _true_noise_scale(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    per_sample = _per_sample_gradients(model, x, y)
    mean = per_sample.mean(0)
    spread = ((per_sample - mean) ** 2).sum(1).mean()
    return float(spread / (mean @ mean))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--every", type=int, default=20, help="steps between rows")
    parser.add_argument("--sigmas", type=float, default=2.0, help="PlannerConfig.gns_sigmas")
    parser.add_argument("--restart-sigmas", type=float, default=4.0)
    parser.add_argument("--restart-smoothing", type=float, default=0.95)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "digits.npz"
        save_digits_split(path, seed=0)
        data = np.load(path)
        x, y = torch.tensor(data["x_train"]), torch.tensor(data["y_train"])
        x_test, y_test = torch.tensor(data["x_test"]), torch.tensor(data["y_test"])
    torch.manual_seed(0)
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    batch = sum(SPLIT)
    trackers = {s: NoiseScaleTracker(s, init_batch=batch, restart_sigmas=None)
                for s in SMOOTHINGS}
    used = NoiseScaleTracker(init_batch=batch, restart_sigmas=args.restart_sigmas,
                             restart_smoothing=args.restart_smoothing)
    order = torch.Generator().manual_seed(0)
    print(f"{'step':>5} {'acc':>6} {'true':>7} "
          + " ".join(f"{s:>8}" for s in SMOOTHINGS)
          + f" {'used':>8} {'cautious':>9} restarts")
    step = 0
    for _ in range(args.epochs):
        perm = torch.randperm(len(x), generator=order)
        for start in range(0, len(x) - batch + 1, batch):
            index = perm[start:start + batch]
            per_sample = _per_sample_gradients(model, x[index], y[index])
            local = [float(part.mean(0).pow(2).sum()) for part in torch.split(per_sample, SPLIT)]
            total = float(per_sample.mean(0).pow(2).sum())
            for tracker in (*trackers.values(), used):
                tracker.update(local, SPLIT, total)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
            step += 1
            if step % args.every:
                continue
            with torch.no_grad():
                accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
            estimates = " ".join(f"{t.noise_scale():8.1f}" for t in trackers.values())
            cautious = used.cautious_noise_scale(args.sigmas)
            shown = "-" if cautious is None else f"{cautious:.1f}"
            print(f"{step:5d} {100 * accuracy:5.1f}% {_true_noise_scale(model, x, y):7.1f} "
                  f"{estimates} {used.noise_scale():8.1f} {shown:>9} {used.restarts:8d}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
