"""Cannikin's torchrun defaults (cannikin.runtime.launch_args): a pure argv rewrite, with the
endpoint probe faked (tests/test_hostaddr.py tests the real one on loopback, test_netns.py
across two network namespaces)."""

from __future__ import annotations

import argparse

import pytest

from cannikin.cli import build_parser, main
from cannikin.runtime.hostaddr import EndpointView
from cannikin.runtime.launch_args import (
    DEFAULT_EXIT_BARRIER_TIMEOUT_S,
    EXIT_BARRIER_ENV,
    FLAG_OPTIONS,
    SHARE_STORE_ENV,
    VALUE_OPTIONS,
    EndpointProbe,
    LaunchArgsError,
    conf_keys,
    with_cannikin_defaults,
)

KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=3"
DEFAULTS = f"last_call_timeout=1,{KEEP_ALIVE}"
"""What a c10d --rdzv-conf gets where the user set none of these keys."""

C10D = ["--nnodes=1:4", "--nproc-per-node=1", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-id=job"]


def rewrite(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    return list(with_cannikin_defaults(argv, env or {}).argv)


def test_c10d_without_conf_gets_the_defaults_before_the_script() -> None:
    argv = [*C10D, "train.py", "--lr", "0.1"]
    assert rewrite(argv) == [*C10D, f"--rdzv-conf={DEFAULTS}", "train.py", "--lr", "0.1"]


def test_user_rdzv_conf_is_merged_and_keeps_its_keys() -> None:
    out = rewrite([*C10D, "--rdzv-conf=join_timeout=60,is_host=1", "train.py"])
    assert out == [*C10D, f"--rdzv-conf=join_timeout=60,is_host=1,{DEFAULTS}",
                   "train.py"]


@pytest.mark.parametrize("conf", ["last_call_timeout=7", "join_timeout=5, last_call_timeout =7"])
def test_user_last_call_timeout_is_kept(conf: str) -> None:
    argv = [*C10D, f"--rdzv-conf={conf}", "train.py"]
    assert rewrite(argv) == [*C10D, f"--rdzv-conf={conf},{KEEP_ALIVE}", "train.py"]


@pytest.mark.parametrize("conf", ["keep_alive_interval=3", "keep_alive_max_attempt=2",
                                  "keep_alive_interval=2,keep_alive_max_attempt=9"])
def test_a_users_keep_alive_key_keeps_c10ds_other_one(conf: str) -> None:
    """The window is interval x attempts: a user's interval must not meet our count."""
    argv = [*C10D, f"--rdzv-conf={conf},last_call_timeout=4", "train.py"]
    assert rewrite(argv) == argv


def test_flag_space_value_form() -> None:
    argv = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
            "--rdzv_conf", "timeout=9", "-m", "pkg.train", "--epochs", "2"]
    out = rewrite(argv)
    assert out == [*argv[:7], f"timeout=9,{DEFAULTS}", *argv[8:]]


def test_flag_equals_form_keeps_the_users_spelling() -> None:
    out = rewrite(["--rdzv_backend=c10d", "--rdzv_conf=a=1,", "train.py"])
    assert out == ["--rdzv_backend=c10d", f"--rdzv_conf=a=1,{DEFAULTS}", "train.py"]


def test_abbreviated_options_are_recognised_as_argparse_does() -> None:
    out = rewrite(["--rdzv-b", "c10d", "--nproc", "2", "train.py"])
    assert out == ["--rdzv-b", "c10d", "--nproc", "2", f"--rdzv-conf={DEFAULTS}",
                   "train.py"]


def test_script_args_are_never_touched() -> None:
    tail = ["train.py", "--rdzv-backend=c10d", "--rdzv-conf=x=1", "--standalone"]
    assert rewrite(["--nnodes=1:2", "--rdzv-backend", "static", *tail]) == [
        "--nnodes=1:2", "--rdzv-backend", "static", *tail]
    assert rewrite(["--rdzv-backend=c10d", "-r3", "--", *tail]) == [
        "--rdzv-backend=c10d", "-r3", f"--rdzv-conf={DEFAULTS}", "--", *tail]


def test_standalone_and_static_are_untouched() -> None:
    for argv in (["--standalone", "--nproc-per-node=3", "train.py"],
                 ["--standalone", "--rdzv-backend=c10d", "train.py"],
                 ["--nnodes=2", "--node-rank=0", "--master-addr=h", "train.py"]):
        assert rewrite(argv) == argv


def test_torchrun_environment_defaults_are_honoured() -> None:
    argv = ["--nnodes=1:2", "train.py"]
    merged = rewrite(argv, {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_CONF": "join_timeout=9"})
    assert merged == ["--nnodes=1:2", f"--rdzv-conf=join_timeout=9,{DEFAULTS}",
                      "train.py"]
    assert rewrite(argv, {"PET_RDZV_BACKEND": "c10d", "PET_STANDALONE": "1"}) == argv
    assert rewrite(argv, {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_CONF": "last_call_timeout=3"}
                   ) == ["--nnodes=1:2", f"--rdzv-conf=last_call_timeout=3,{KEEP_ALIVE}",
                         "train.py"]


def test_exit_barrier_is_30_s_unless_the_user_set_it() -> None:
    launched = with_cannikin_defaults(["--standalone", "train.py"], {})
    assert launched.exit_barrier_timeout_s == DEFAULT_EXIT_BARRIER_TIMEOUT_S == 30
    assert launched.added[-1] == "exit barrier 30 s"
    mine = with_cannikin_defaults(["train.py"], {EXIT_BARRIER_ENV: " 120.5 "})
    assert mine.exit_barrier_timeout_s == 120.5
    assert not any("exit barrier" in a for a in mine.added)
    for bad in ("soon", "-1", "inf"):
        with pytest.raises(LaunchArgsError, match=f"^{EXIT_BARRIER_ENV}={bad} is not valid: it "
                           "must be a number of seconds >= 0$"):
            with_cannikin_defaults(["train.py"], {EXIT_BARRIER_ENV: bad})


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


ACROSS = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
          "--rdzv-endpoint=10.9.0.1:29400", "--rdzv-id=job"]


def fake_probe(owned: bool, served: bool = False, local_addr: str = "10.9.0.5",
               seen: list[tuple[str, int]] | None = None) -> EndpointProbe:
    def probe(host: str, port: int) -> EndpointView:
        if seen is not None:
            seen.append((host, port))
        return EndpointView(owned=owned, served=served, local_addr=local_addr)
    return probe


def test_the_endpoints_owner_hosts_the_store_and_every_host_gets_its_address() -> None:
    seen: list[tuple[str, int]] = []
    owner = with_cannikin_defaults([*ACROSS, "train.py"], {},
                                   probe=fake_probe(True, local_addr="10.9.0.1", seen=seen))
    assert owner.argv == (*ACROSS, f"--rdzv-conf={DEFAULTS},is_host=1",
                          "--local-addr=10.9.0.1", "train.py")
    assert owner.added[:2] == (f"--rdzv-conf {DEFAULTS},is_host=1",
                               "--local-addr 10.9.0.1")
    assert seen == [("10.9.0.1", 29400)]
    other = with_cannikin_defaults([*ACROSS, "train.py"], {}, probe=fake_probe(False))
    assert other.argv == (*ACROSS, f"--rdzv-conf={DEFAULTS}",
                          "--local-addr=10.9.0.5", "train.py")


def test_an_owner_whose_store_is_already_served_joins_it_as_a_client() -> None:
    """A second agent on the endpoint's host: torchrun's own retry as a client must stay."""
    out = rewrite_probed([*ACROSS, "train.py"], fake_probe(True, served=True))
    assert out == [*ACROSS, f"--rdzv-conf={DEFAULTS}", "--local-addr=10.9.0.5",
                   "train.py"]


def rewrite_probed(argv: list[str], probe: EndpointProbe,
                   env: dict[str, str] | None = None) -> list[str]:
    return list(with_cannikin_defaults(argv, env or {}, probe=probe).argv)


def test_the_users_is_host_and_local_addr_win() -> None:
    argv = [*ACROSS, "--rdzv-conf", f"is_host=0,last_call_timeout=5,{KEEP_ALIVE}",
            "--local_addr=n1", "train.py"]
    assert rewrite_probed(argv, fake_probe(True)) == argv
    env = {"PET_LOCAL_ADDR": "n1", "PET_RDZV_CONF": "is_host=false"}
    assert rewrite_probed([*ACROSS, "train.py"], fake_probe(True), env) == [
        *ACROSS, f"--rdzv-conf=is_host=false,{DEFAULTS}", "train.py"]


@pytest.mark.parametrize("endpoint", ["127.0.0.1:29400", "localhost:5", "[::1]:7", "127.0.0.2"])
def test_loopback_endpoints_are_not_probed(endpoint: str) -> None:
    """Every agent is on this machine; torchrun's own detection handles it (with its retry)."""
    seen: list[tuple[str, int]] = []
    argv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "train.py"]
    assert rewrite_probed(argv, fake_probe(True, seen=seen)) == [
        *argv[:2], f"--rdzv-conf={DEFAULTS}", "train.py"]
    assert seen == []


def test_endpoint_forms_and_unresolvable_endpoints() -> None:
    seen: list[tuple[str, int]] = []
    probe = fake_probe(False, seen=seen)
    for endpoint in ("node1", "node1:29500", "[fd00::1]:29501", "fd00::2"):
        rewrite_probed(["--rdzv-backend=c10d", "--rdzv-endpoint", endpoint, "t.py"], probe)
    assert seen == [("node1", 29400), ("node1", 29500), ("fd00::1", 29501), ("fd00::2", 29400)]
    argv = [*ACROSS, "--", "train.py"]
    assert rewrite_probed(argv, lambda host, port: None) == [
        *ACROSS, f"--rdzv-conf={DEFAULTS}", "--", "train.py"]
    assert rewrite_probed(argv, fake_probe(False)) == [
        *ACROSS, f"--rdzv-conf={DEFAULTS}", "--local-addr=10.9.0.5", "--", "train.py"]


def test_standalone_and_static_are_not_probed() -> None:
    seen: list[tuple[str, int]] = []
    for argv in (["--standalone", "--rdzv-backend=c10d", "--rdzv-endpoint=10.9.0.1", "t.py"],
                 ["--nnodes=2", "--rdzv-endpoint=10.9.0.1:1", "t.py"]):
        assert rewrite_probed(argv, fake_probe(True, seen=seen)) == argv
    assert seen == []


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--nproc-per-node=0"], {}, "--nproc-per-node 0 is not valid: it must be a positive "
     "integer or one of auto, cpu, gpu, xpu"),
    (["--nproc_per_node", "two"], {}, "--nproc_per_node two is not valid"),
    ([], {"PET_NPROC_PER_NODE": "-1"}, "PET_NPROC_PER_NODE -1 is not valid"),
    (["--nnodes=3:2"], {}, "--nnodes 3:2 is not valid: it must be N or MIN:MAX with integers "
     "1 <= MIN <= MAX"),
    (["--nnodes", "0"], {}, "--nnodes 0 is not valid"),
    (["--nnodes=1:2:3"], {}, "--nnodes 1:2:3 is not valid"),
    (["--nnodes=a:2"], {}, "--nnodes a:2 is not valid"),
    (["--max-restarts=-1"], {}, "--max-restarts -1 is not valid: it must be an integer >= 0"),
    (["--monitor-interval=0"], {}, "--monitor-interval 0 is not valid: it must be a positive "
     "number of seconds"),
    (["--monitor_interval=nan"], {}, "--monitor_interval nan is not valid"),
    (["--rdzv-endpoint=h:99999"], {}, "--rdzv-endpoint h:99999 is not valid: the port "
     "'99999' must be an integer in 1..65535"),
    (["--rdzv-endpoint=[fd00::1]:x"], {}, "--rdzv-endpoint [fd00::1]:x is not valid"),
])
def test_values_torchrun_rejects_with_a_traceback_are_refused_by_name(
        argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchArgsError) as error:
        with_cannikin_defaults([*argv, "train.py"], env)
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.parametrize("argv", [
    ["--nproc-per-node=auto", "--nnodes=1:4", "--max-restarts=0", "--monitor-interval=0.5"],
    ["--nproc-per-node", "3", "--nnodes", "2", "--rdzv-endpoint=[fd00::1]:29400"],
    ["--nproc-per-node=0", "-h"],  # torchrun prints its help, whatever the values
])
def test_valid_values_and_help_pass(argv: list[str]) -> None:
    with_cannikin_defaults([*argv, "train.py"], {})


def test_cli_refuses_a_bad_value_in_one_line_with_status_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--nproc-per-node=0", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err == ("cannikin launch: error: --nproc-per-node 0 is not valid: it must be a "
                   "positive integer or one of auto, cpu, gpu, xpu\n")
