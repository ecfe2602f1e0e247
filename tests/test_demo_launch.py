"""The demo's launcher: torchrun on a free port, worker environment, failures and the hard
timeout (a hung worker is killed, never left running)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cannikin.demo.launch import (
    LaunchError,
    failure_excerpt,
    run_local,
    torchrun_command,
    worker_env,
)

TESTS = Path(__file__).resolve().parent


def launch(tmp_path: Path, mode: str, timeout_s: float) -> None:
    env = worker_env((4.0, 1.0))
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{TESTS}"
    command = torchrun_command(2, "demo_dummy_worker", [str(tmp_path), mode])
    run_local(command, env=env, log_path=tmp_path / "workers.log", timeout_s=timeout_s)


def ranks(tmp_path: Path) -> list[dict[str, str]]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.mark.timeout(60)
def test_failing_worker_raises_with_exit_code_and_environment_is_set(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="exit code 1"):
        launch(tmp_path, "fail", timeout_s=50)
    for rank, info in enumerate(ranks(tmp_path)):
        assert info["RANK"] == str(rank) and info["WORLD_SIZE"] == "2"
        assert info["OMP_NUM_THREADS"] == "1"
        assert info["CANNIKIN_SLOWDOWN"] == "4,1"
    assert "exit" in (tmp_path / "workers.log").read_text()


def test_quota_workers_get_their_groups_and_no_inherited_slowdown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CANNIKIN_SLOWDOWN", "3")
    monkeypatch.setenv("CANNIKIN_CPU_QUOTA", "9")
    env = worker_env(None, {"CANNIKIN_CPU_QUOTA": "1,0.5", "CANNIKIN_CPU_QUOTA_GROUPS": "/g"})
    assert "CANNIKIN_SLOWDOWN" not in env
    assert (env["CANNIKIN_CPU_QUOTA"], env["CANNIKIN_CPU_QUOTA_GROUPS"]) == ("1,0.5", "/g")
    emulated = worker_env((4.0, 1.0))
    assert emulated["CANNIKIN_SLOWDOWN"] == "4,1" and "CANNIKIN_CPU_QUOTA" not in emulated


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
def test_hung_workers_are_killed_at_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timeout"):
        launch(tmp_path, "hang", timeout_s=8)
    assert time.monotonic() - start < 8 + 12
    # torchrun and every worker it started have the test's directory on their command line
    assert processes_mentioning(str(tmp_path)) == []


def test_failure_excerpt_shows_the_first_traceback(tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    log.write_text("noise\nTraceback (most recent call last):\n  File x\nValueError: bad\n"
                   "summary\nTraceback (most recent call last):\nOther: later\n")
    assert failure_excerpt(log) == "Traceback (most recent call last):\n  File x\nValueError: bad"
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    assert failure_excerpt(log, lines=3) == "line 37\nline 38\nline 39"
    assert failure_excerpt(tmp_path / "missing.log") == ""
