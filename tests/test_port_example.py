"""The porting guide's pair: a DDP-tutorial-shaped script and its Cannikin port, both run.

``examples/port/ddp_trainer.py`` (a Trainer class with snapshots, ``set_epoch``, an eval
loop, gradient clipping, a StepLR scheduler) and ``cannikin_trainer.py`` train the same
model on the same data on 2 gloo workers; the port must train as well, resume from its
snapshot, and stay a small diff (README: "the whole port").
"""

import difflib
import re
from pathlib import Path

from dist_utils import ROOT, start_torchrun

PORT = ROOT / "examples" / "port"
EPOCH = re.compile(r"epoch (\d+): training loss ([\d.]+), held-out accuracy ([\d.]+)")


def _epochs(stdout: str) -> list[tuple[int, float, float]]:
    return [(int(e), float(loss), float(acc)) for e, loss, acc in EPOCH.findall(stdout)]


def test_the_port_trains_like_ddp_and_resumes(tmp_path: Path) -> None:
    env = {"CANNIKIN_SLOWDOWN": ""}
    jobs = {name: start_torchrun(PORT / f"{name}_trainer.py", nproc=2, env=env,
                                 script_args=["--epochs", "3", "--snapshot",
                                              str(tmp_path / f"{name}.pt")])
            for name in ("ddp", "cannikin")}
    results = {name: job.wait(180.0)[0].check() for name, job in jobs.items()}
    runs = {name: _epochs(result.stdout) for name, result in results.items()}
    for name, epochs in runs.items():
        assert [e for e, _, _ in epochs] == [0, 1, 2], (name, results[name].stdout)
        assert epochs[-1][1] < epochs[0][1] and epochs[-1][2] > 0.85, (name, epochs)
    # the same samples per epoch, summed in another order: the losses agree closely
    assert abs(runs["cannikin"][-1][1] - runs["ddp"][-1][1]) < 0.05, runs
    resumed = start_torchrun(PORT / "cannikin_trainer.py", nproc=2, env=env,
                             script_args=["--epochs", "4", "--snapshot",
                                          str(tmp_path / "cannikin.pt")]).wait(120.0)[0].check()
    assert [e for e, _, _ in _epochs(resumed.stdout)] == [3]  # from the snapshot on


def test_the_port_is_a_small_diff() -> None:
    ddp, port = ((PORT / f"{name}_trainer.py").read_text().split('"""', 2)[2].splitlines()
                 for name in ("ddp", "cannikin"))
    changed = [line for line in difflib.unified_diff(ddp, port, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")) and line.strip("+-")]
    # 12, and the 3 lines of the DDP twin's wait for torch 2.13's exit race, which the port drops
    assert len(changed) <= 15, "\n".join(changed)
