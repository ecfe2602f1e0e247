"""`cannikin demo` argument handling: defaults, and one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cannikin.cli import _Parser
from cannikin.cli import demo as demo_cli
from cannikin.demo.config import DemoConfig, default_speeds, machine_worker_limit


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="cannikin")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo_cli.register(sub)
    return parser.parse_args(["demo", *argv])


def config_of(argv: list[str]) -> DemoConfig:
    config: DemoConfig = demo_cli._config(parse(argv))
    return config


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse and validate argv, expecting exit status 2; return the single stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        config_of(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def test_defaults_are_four_workers_with_speeds_1_1_2_4() -> None:
    config = config_of([])
    assert config.speeds == (1.0, 1.0, 2.0, 4.0)
    assert config.epochs == demo_cli.DEFAULT_EPOCHS and config.steps is None
    assert not config.adaptive_batch
    assert config.slowdowns == (4.0, 4.0, 2.0, 1.0)


def test_speeds_set_the_worker_count_and_options_are_passed() -> None:
    config = config_of(["--speeds", "1,2,4", "--steps", "12", "--adaptive-batch",
                        "--batch-size", "32", "--seed", "3"])
    assert config.speeds == (1.0, 2.0, 4.0)
    assert (config.steps, config.epochs, config.batch_size, config.seed) == (12, None, 32, 3)
    assert config.adaptive_batch
    assert config.sample_budget(1437) == 12 * 32
    assert config_of(["--epochs", "2"]).sample_budget(1437) == 2 * 1437


@pytest.mark.parametrize(("workers", "speeds"), [
    (2, (1.0, 4.0)), (3, (1.0, 2.0, 4.0)), (4, (1.0, 1.0, 2.0, 4.0)),
    (5, (1.0, 1.0, 2.0, 2.0, 4.0)),
])
def test_default_speeds_spread_one_to_four(workers: int, speeds: tuple[float, ...]) -> None:
    assert default_speeds(workers) == speeds
    assert config_of(["--workers", str(workers)]).speeds == speeds


def test_unknown_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--bogus" in usage_error(["--bogus"], capsys)


def test_speeds_not_matching_workers(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["--workers", "4", "--speeds", "1,2,4"], capsys)
    assert "3 values (1,2,4)" in err and "--workers is 4" in err


@pytest.mark.parametrize("speeds", ["1,0,2", "1,-2", "1,nan", "1,x"])
def test_non_positive_or_non_numeric_speed(speeds: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["--speeds", speeds], capsys)
    assert speeds in err and "positive" in err


def test_more_workers_than_the_machine_holds(capsys: pytest.CaptureFixture[str]) -> None:
    limit = machine_worker_limit()
    err = usage_error(["--workers", str(limit + 1)], capsys)
    assert f"workers {limit + 1}" in err and f"2 to {limit}" in err


def test_one_worker_is_not_a_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert "2 to" in usage_error(["--speeds", "3"], capsys)


@pytest.mark.parametrize("argv", [["--workers", "0"], ["--steps", "0"], ["--epochs", "-1"],
                                  ["--batch-size", "x"], ["--timeout", "0"]])
def test_non_positive_numbers(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert argv[0] in usage_error(argv, capsys)


def test_epochs_and_steps_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    assert "not allowed" in usage_error(["--epochs", "1", "--steps", "3"], capsys)


def test_batch_smaller_than_worker_count(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["--batch-size", "3"], capsys)
    assert "batch size 3" in err and "4 workers" in err


def test_unwritable_output_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere" / "report.json"
    assert "does not exist" in usage_error(["--json", str(missing)], capsys)
    assert "does not exist" in usage_error(["--plot", str(missing)], capsys)
    a_file = tmp_path / "file"
    a_file.touch()
    assert "not a directory" in usage_error(["--out", str(a_file)], capsys)
    assert "is a directory, expected a file path" in usage_error(["--json", str(tmp_path)],
                                                                 capsys)


def test_config_round_trips_through_json() -> None:
    config = config_of(["--speeds", "1,2.5,4", "--steps", "5"])
    assert DemoConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize(("argv", "needle"), [
    (["--speeds", "1,2,4", "--workers", "2"], "--workers is 2"),
    (["--bogus"], "--bogus"),
])
def test_installed_command_exits_2_with_one_line(argv: list[str], needle: str) -> None:
    """Through the real entry point (cannikin.cli.main), in a fresh interpreter."""
    src = Path(__file__).resolve().parents[1] / "src"
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from cannikin.cli import main; sys.exit(main())",
         "demo", *argv],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_parent_side_never_imports_torch() -> None:
    """The parent process only launches and reports: importing it with torch blocked works."""
    from test_pure_imports import BLOCK_TORCH

    src = Path(__file__).resolve().parents[1] / "src"
    modules = ["cannikin.cli.demo", "cannikin.demo.run", "cannikin.demo.progress",
               "cannikin.demo.plot", "cannikin.demo.digits"]
    code = "\n".join(BLOCK_TORCH.format(module=m) for m in modules)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(src)})
    assert result.returncode == 0, result.stderr


def test_quota_mode_gives_shares_proportional_to_the_speeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cannikin.runtime.quota import Hierarchy

    monkeypatch.setattr(demo_cli, "find_hierarchy", lambda: Hierarchy(1, tmp_path))
    monkeypatch.setattr(demo_cli, "usable_cores", lambda hierarchy: 2.0)
    config = config_of(["--heterogeneity", "quota", "--speeds", "1,2,4"])
    assert config.cpu_shares == (0.25, 0.5, 1.0) and config.heterogeneity == "quota"
    assert DemoConfig.from_json(config.to_json()) == config
    assert config_of(["--speeds", "1,2,4"]).cpu_shares is None  # emulation stays the default


def test_quota_mode_without_writable_cgroups_exits_2_naming_the_fallback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cannikin.runtime.quota import QuotaUnavailable

    def unavailable() -> None:
        raise QuotaUnavailable("CPU quotas unavailable: /sys/fs/cgroup/cpu is mounted "
                               "read-only; fall back to ... --heterogeneity emulate")

    monkeypatch.setattr(demo_cli, "find_hierarchy", unavailable)
    err = usage_error(["--heterogeneity", "quota"], capsys)
    assert "--heterogeneity quota: CPU quotas unavailable" in err
    assert "--heterogeneity emulate" in err


def test_quota_mode_refuses_a_share_below_the_kernels_minimum(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from cannikin.runtime.quota import Hierarchy

    monkeypatch.setattr(demo_cli, "find_hierarchy", lambda: Hierarchy(1, tmp_path))
    monkeypatch.setattr(demo_cli, "usable_cores", lambda hierarchy: 2.0)
    err = usage_error(["--heterogeneity", "quota", "--speeds", "1,20"], capsys)
    assert "share 0.05 of rank 0" in err and "at least 0.1 cores" in err


def test_missing_demo_packages_are_named_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # `pip install -e .` alone has no rich or scikit-learn: say what to install, no traceback
    real = demo_cli.importlib.util.find_spec
    monkeypatch.setattr(demo_cli.importlib.util, "find_spec",
                        lambda name: None if name in ("rich", "sklearn") else real(name))
    with pytest.raises(SystemExit) as exit_info:
        demo_cli._run(parse([]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "needs rich, scikit-learn" in err and "cannikin[demo,torch]" in err


def test_a_target_runs_three_phases_with_the_goodput_batch() -> None:
    config = config_of(["--target", "0.9"])
    assert config.target == 0.9
    assert [p for p, _ in config.phases] == ["even", "adaptdl", "cannikin"]
    assert not config.adapts_batch("even")
    assert config.adapts_batch("adaptdl") and config.adapts_batch("optimal")
    assert DemoConfig.from_json(config.to_json()) == config
    assert [p for p, _ in config_of([]).phases] == ["even", "cannikin"]
    assert not config_of([]).adapts_batch("optimal")


@pytest.mark.parametrize("target", ["0", "1", "1.5", "-0.2", "ninety"])
def test_a_target_outside_zero_to_one_is_refused(target: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["--target", target], capsys)
    assert "--target" in err and target in err



def test_the_task_is_passed() -> None:
    assert config_of([]).task == "digits"
    config = config_of(["--task", "teacher"])
    assert config.task == "teacher"
    assert DemoConfig.from_json(config.to_json()) == config


def test_an_unknown_task_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["--task", "mnist"], capsys)
    assert "--task" in err and "'mnist'" in err


def test_the_lr_decay_is_passed(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_of([]).lr_decay is None
    config = config_of(["--lr-decay", "progress"])
    assert config.lr_decay == "progress"
    assert DemoConfig.from_json(config.to_json()) == config
    err = usage_error(["--lr-decay", "cosine"], capsys)
    assert "--lr-decay" in err and "'cosine'" in err


def test_the_lr_decays_half_way_through_the_budget() -> None:
    """At half the budget's steps of B0 (here 2 epochs of 1000 samples at 50: 20 of them),
    whatever counts them; a constant rate without a decay."""
    config = DemoConfig(epochs=2, batch_size=50, lr_decay="steps")
    assert [config.lr_factor(p, 1000) for p in (0, 19.9, 20, 400)] == [1.0, 1.0, 0.1, 0.1]
    assert DemoConfig(epochs=2, batch_size=50).lr_factor(400, 1000) == 1.0
    with pytest.raises(ValueError, match="lr_decay 'cosine' is not valid: give one of steps, "
                                         "progress or None"):
        DemoConfig(epochs=2, lr_decay="cosine")
