"""Cannikin's torchrun defaults (cannikin.runtime.launch_args): a pure argv rewrite."""

from __future__ import annotations

import argparse

import pytest

from cannikin.cli import build_parser
from cannikin.runtime.launch_args import (
    FLAG_OPTIONS,
    SHARE_STORE_ENV,
    VALUE_OPTIONS,
    conf_keys,
    with_cannikin_defaults,
)

C10D = ["--nnodes=1:4", "--nproc-per-node=1", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-id=job"]


def rewrite(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    return list(with_cannikin_defaults(argv, env or {}).argv)


def test_c10d_without_conf_gets_last_call_before_the_script() -> None:
    argv = [*C10D, "train.py", "--lr", "0.1"]
    assert rewrite(argv) == [*C10D, "--rdzv-conf=last_call_timeout=1", "train.py", "--lr", "0.1"]


def test_user_rdzv_conf_is_merged_and_keeps_its_keys() -> None:
    out = rewrite([*C10D, "--rdzv-conf=join_timeout=60,is_host=1", "train.py"])
    assert out == [*C10D, "--rdzv-conf=join_timeout=60,is_host=1,last_call_timeout=1",
                   "train.py"]


@pytest.mark.parametrize("conf", ["last_call_timeout=7", "join_timeout=5, last_call_timeout =7"])
def test_user_last_call_timeout_is_kept(conf: str) -> None:
    argv = [*C10D, f"--rdzv-conf={conf}", "train.py"]
    assert rewrite(argv) == argv


def test_flag_space_value_form() -> None:
    argv = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
            "--rdzv_conf", "timeout=9", "-m", "pkg.train", "--epochs", "2"]
    out = rewrite(argv)
    assert out == [*argv[:7], "timeout=9,last_call_timeout=1", *argv[8:]]


def test_flag_equals_form_keeps_the_users_spelling() -> None:
    out = rewrite(["--rdzv_backend=c10d", "--rdzv_conf=a=1,", "train.py"])
    assert out == ["--rdzv_backend=c10d", "--rdzv_conf=a=1,last_call_timeout=1", "train.py"]


def test_abbreviated_options_are_recognised_as_argparse_does() -> None:
    out = rewrite(["--rdzv-b", "c10d", "--nproc", "2", "train.py"])
    assert out == ["--rdzv-b", "c10d", "--nproc", "2", "--rdzv-conf=last_call_timeout=1",
                   "train.py"]


def test_script_args_are_never_touched() -> None:
    tail = ["train.py", "--rdzv-backend=c10d", "--rdzv-conf=x=1", "--standalone"]
    assert rewrite(["--nnodes=1:2", "--rdzv-backend", "static", *tail]) == [
        "--nnodes=1:2", "--rdzv-backend", "static", *tail]
    assert rewrite(["--rdzv-backend=c10d", "-r3", "--", *tail]) == [
        "--rdzv-backend=c10d", "-r3", "--rdzv-conf=last_call_timeout=1", "--", *tail]


def test_standalone_and_static_are_untouched() -> None:
    for argv in (["--standalone", "--nproc-per-node=3", "train.py"],
                 ["--standalone", "--rdzv-backend=c10d", "train.py"],
                 ["--nnodes=2", "--node-rank=0", "--master-addr=h", "train.py"]):
        assert rewrite(argv) == argv


def test_torchrun_environment_defaults_are_honoured() -> None:
    argv = ["--nnodes=1:2", "train.py"]
    merged = rewrite(argv, {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_CONF": "join_timeout=9"})
    assert merged == ["--nnodes=1:2", "--rdzv-conf=join_timeout=9,last_call_timeout=1",
                      "train.py"]
    assert rewrite(argv, {"PET_RDZV_BACKEND": "c10d", "PET_STANDALONE": "1"}) == argv
    assert rewrite(argv, {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_CONF": "last_call_timeout=3"}
                   ) == argv


def test_share_store_variable_is_set_only_when_the_user_did_not() -> None:
    assert with_cannikin_defaults(["train.py"], {}).env == {SHARE_STORE_ENV: "1"}
    assert with_cannikin_defaults(["train.py"], {SHARE_STORE_ENV: "0"}).env == {}


def test_conf_keys_split_like_torchrun() -> None:
    assert conf_keys("") == set()
    assert conf_keys(" a=1 , b = 2,") == {"a", "b"}


def test_cli_passes_everything_through_unparsed() -> None:
    argv = ["--nnodes=1:2", "-h", "train.py", "--help", "--x=1"]
    args = build_parser().parse_args(["launch", *argv])
    assert args.torchrun_args == argv


def test_option_tables_match_torchrun() -> None:
    """If a torch upgrade adds or changes a torchrun option, the rewrite must learn it."""
    run = pytest.importorskip("torch.distributed.run")
    values, flags = {}, {}
    for action in run.get_args_parser()._actions:
        if not action.option_strings:
            continue
        assert action.nargs in (None, 0), action
        table = flags if action.nargs == 0 else values
        table.update(dict.fromkeys(action.option_strings, action.dest))
        assert not isinstance(action, argparse._AppendAction), action
    assert values == VALUE_OPTIONS
    assert flags == FLAG_OPTIONS
