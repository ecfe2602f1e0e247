"""``cannikin launch``: torchrun with Cannikin's defaults, so users never pass them by hand.

``cannikin launch [torchrun options] script.py [script args]`` accepts exactly what
``torchrun`` accepts and runs torchrun's own entry point in this process, after adding only
what the user did not set (see :mod:`cannikin.runtime.launch_args`): ``last_call_timeout=1``
in ``--rdzv-conf`` for a c10d rendezvous (c10d's 30 s default makes every elastic start and
membership change wait half a minute) and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the
agent's environment (a fresh rendezvous store per worker generation). With a c10d
``--rdzv-endpoint=HOST:PORT`` that is not loopback, the same command line works on every
host: the host that owns HOST's address gets ``is_host=1`` and every host ``--local-addr`` (its
address toward HOST), found by asking the kernel (:mod:`cannikin.runtime.hostaddr`). A value
torchrun would reject with a traceback (``--nproc-per-node=0``) exits 2 with one line first.
c10d heartbeats every second, a node dropped after 3 missed (``keep_alive_interval=1,
keep_alive_max_attempt=3``: node loss waits 3 s for it, not 15), the exit barrier waits 30 s
(``CANNIKIN_EXIT_BARRIER_TIMEOUT_S``) where torchrun waits 300 s with no option to change it.
``python -m cannikin.launch`` is the same command.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from cannikin.log import setup_logging
from cannikin.runtime.hostaddr import probe_endpoint
from cannikin.runtime.launch_args import LaunchArgsError, with_cannikin_defaults

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    # No option of its own and no prefix characters: every argument, "-h" included, goes to
    # torchrun unparsed (argparse.REMAINDER alone still grabs a leading "--nnodes=...").
    p = subparsers.add_parser(
        "launch", help="torchrun with Cannikin's defaults (same options as torchrun)",
        description=__doc__.splitlines()[0], add_help=False, prefix_chars="\0")
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER,
                   help="torchrun options, the training script and its arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return launch(args.torchrun_args)


def _exit_barrier_timeout(seconds: float) -> contextlib.AbstractContextManager[Any]:
    """torchrun's agents with ``exit_barrier_timeout=seconds`` while the block runs.

    torch 2.13's launcher builds its ``LocalElasticAgent`` without passing the timeout (so
    300 s) and has no option for it; the class it calls is swapped for one with this default.
    """
    from unittest import mock

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    class Agent(LocalElasticAgent):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("exit_barrier_timeout", seconds)
            super().__init__(*args, **kwargs)

    return mock.patch.object(api, "LocalElasticAgent", Agent)


def launch(argv: Sequence[str]) -> int:
    """Run torchrun on ``argv`` with Cannikin's defaults; 0 on success, 1 if workers failed,
    2 (one line on stderr, nothing started) for a bad launcher value."""
    setup_logging(0, False)
    try:
        launch_args = with_cannikin_defaults(argv, os.environ, probe=probe_endpoint)
    except LaunchArgsError as error:
        print(f"cannikin launch: error: {error}", file=sys.stderr)
        return 2
    for name, value in launch_args.env.items():
        os.environ[name] = value  # the agent reads it; its workers inherit it
    if launch_args.added:
        logger.info("cannikin launch adds: %s", "; ".join(launch_args.added))

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        with _exit_barrier_timeout(launch_args.exit_barrier_timeout_s):
            torchrun_main(list(launch_args.argv))
    except ChildFailedError as error:
        logger.error("%s", error)  # torchrun's summary: which workers failed, how, where
        return 1
    return 0
