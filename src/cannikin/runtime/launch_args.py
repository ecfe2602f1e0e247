"""Cannikin's torchrun defaults as a pure rewrite of a torchrun command line (no torch import).

``cannikin launch`` is torchrun with defaults that a library inside the worker cannot set,
because they belong to the *agent* (the torchrun process), not to the workers:

* ``last_call_timeout=1`` in ``--rdzv-conf`` for a c10d rendezvous. c10d waits 30 s by default
  after the minimum number of nodes has joined before it closes a round, so every elastic
  start and every membership change would cost half a minute.
* ``keep_alive_interval=1,keep_alive_max_attempt=3`` there too, unless the user set either:
  c10d drops a node from the rendezvous once its heartbeat is ``interval x attempts`` old
  (5 s x 3 = 15 s by default), and the survivors of a lost node wait that long before their
  next round can close, so node loss cost 16-31 s; now 3 s of it. The heartbeat age is
  compared across hosts' wall clocks, so the window also bounds the clock skew c10d
  tolerates (3 s; NTP keeps hosts within milliseconds), and an agent stalled that long is
  dropped (harmless while a round is complete: it rejoins at the next one).
  c10d reads both as integers, so 1 s is its finest interval.
  The user's ``--rdzv-conf`` keys are kept and win; ``--standalone`` (one node, nothing to wait
  for) is left alone.
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agent's environment unless the user set it.
  ``init_distributed`` already survives elastic restarts on torchrun's shared store by agreeing
  on a worker generation (see :mod:`cannikin.runtime.distributed`); a fresh store per
  generation removes the stale keys at the source too, so user code that builds its own
  process group (not through ``init_distributed``) is safe as well: belt and braces.
* An exit barrier of 30 s instead of 300 s (``CANNIKIN_EXIT_BARRIER_TIMEOUT_S`` overrides it;
  torchrun has no option for it): an agent whose workers finished waits there for the other
  agents, so a lost agent kept the survivors of a finished job waiting five minutes.

Across hosts (a c10d ``--rdzv-endpoint`` that is not loopback), given a probe of the
endpoint (:func:`cannikin.runtime.hostaddr.probe_endpoint`), two more, so that the same
command line works on every host:

* ``is_host=1`` in ``--rdzv-conf`` on the host that owns the endpoint address, unless an agent
  on it already serves the store there. torchrun compares the endpoint with the addresses of
  the machine's hostname only, which misses it where the name resolves elsewhere: then no
  agent hosts the store and every one fails after 60 s.
* ``--local-addr=<this host's address toward the endpoint>``: the address rank 0's agent
  advertises for the workers' store (torchrun's default, ``socket.getfqdn()``, may resolve to
  127.0.0.1 or to an interface other hosts cannot reach).

Before any of this the launcher's own values are checked (:class:`LaunchArgsError`, one line
naming the value and what is valid): torchrun reports ``--nproc-per-node=0`` or
``--nnodes=3:2`` with a bare traceback.

Only the options before the training script are read; the script and its arguments are
returned untouched. torchrun's ``PET_*`` environment defaults are honoured like torchrun does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cannikin.runtime.hostaddr import EndpointView, is_loopback

LAST_CALL_TIMEOUT_S = 1
"""Seconds a c10d round waits for more nodes once it has its minimum (c10d's default: 30)."""

KEEP_ALIVE_INTERVAL_S = 1
"""Seconds between an agent's c10d heartbeats (c10d's default: 5; it takes whole seconds)."""
KEEP_ALIVE_MAX_ATTEMPT = 3
"""Heartbeats missed before c10d drops a node (c10d's default too): 3 x 1 s = 3 s, not 15 s."""

RDZV_CONF_DEFAULTS: tuple[dict[str, int], ...] = (
    {"last_call_timeout": LAST_CALL_TIMEOUT_S},
    {"keep_alive_interval": KEEP_ALIVE_INTERVAL_S,
     "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPT},
)
"""What a c10d ``--rdzv-conf`` gets, in this order: each group only if the user set none of
its keys (the heartbeat window is their product, so a user's interval keeps c10d's count)."""

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

EXIT_BARRIER_ENV = "CANNIKIN_EXIT_BARRIER_TIMEOUT_S"
DEFAULT_EXIT_BARRIER_TIMEOUT_S = 30.0
"""Seconds an agent whose workers finished waits for the others (torchrun's fixed 300)."""

DEFAULT_RDZV_PORT = 29400
"""torchrun's port for a c10d ``--rdzv-endpoint`` given without one."""

NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
"""The non-numeric ``--nproc-per-node`` values torchrun understands."""

EndpointProbe = Callable[[str, int], EndpointView | None]
"""``(host, port) -> EndpointView``, or None where the endpoint does not resolve."""


class LaunchArgsError(ValueError):
    """A launcher value torchrun would reject with a traceback; the message names it."""

VALUE_OPTIONS: dict[str, str] = {
    spelling: dest
    for dest, spellings in {
        "nnodes": ("--nnodes",),
        "nproc_per_node": ("--nproc-per-node", "--nproc_per_node"),
        "rdzv_backend": ("--rdzv-backend", "--rdzv_backend"),
        "rdzv_endpoint": ("--rdzv-endpoint", "--rdzv_endpoint"),
        "rdzv_id": ("--rdzv-id", "--rdzv_id"),
        "rdzv_conf": ("--rdzv-conf", "--rdzv_conf"),
        "max_restarts": ("--max-restarts", "--max_restarts"),
        "monitor_interval": ("--monitor-interval", "--monitor_interval"),
        "start_method": ("--start-method", "--start_method"),
        "event_log_handler": ("--event-log-handler", "--event_log_handler"),
        "role": ("--role",),
        "log_dir": ("--log-dir", "--log_dir"),
        "redirects": ("-r", "--redirects"),
        "tee": ("-t", "--tee"),
        "local_ranks_filter": ("--local-ranks-filter", "--local_ranks_filter"),
        "duplicate_stdout_filters": ("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
        "duplicate_stderr_filters": ("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
        "node_rank": ("--node-rank", "--node_rank"),
        "master_addr": ("--master-addr", "--master_addr"),
        "master_port": ("--master-port", "--master_port"),
        "local_addr": ("--local-addr", "--local_addr"),
        "logs_specs": ("--logs-specs", "--logs_specs"),
        "numa_binding": ("--numa-binding", "--numa_binding"),
        "signals_to_handle": ("--signals-to-handle", "--signals_to_handle"),
        "shutdown_timeout": ("--shutdown-timeout", "--shutdown_timeout"),
    }.items()
    for spelling in spellings
}
"""torchrun (torch 2.13) options that take a value, spelling -> argparse dest.
tests/test_launch_args.py checks this table against torch's own parser."""

FLAG_OPTIONS: dict[str, str] = {
    spelling: dest
    for dest, spellings in {
        "help": ("-h", "--help"),
        "standalone": ("--standalone",),
        "module": ("-m", "--module"),
        "no_python": ("--no-python", "--no_python"),
        "run_path": ("--run-path", "--run_path"),
        "virtual_local_rank": ("--virtual-local-rank", "--virtual_local_rank"),
    }.items()
    for spelling in spellings
}
"""torchrun options that take no value, spelling -> argparse dest."""


@dataclass(frozen=True, kw_only=True)
class LaunchArgs:
    """A torchrun command line with Cannikin's defaults, and what to add to the agent's env."""

    argv: tuple[str, ...]
    """Arguments for ``torch.distributed.run.main`` (no program name)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables to set in the agent's environment (only ones the user had not set)."""
    added: tuple[str, ...] = ()
    """What was added, in words, for a log line."""
    exit_barrier_timeout_s: float = DEFAULT_EXIT_BARRIER_TIMEOUT_S
    """How long the agent waits at torchrun's exit barrier for the other agents."""


@dataclass
class _Option:
    dest: str
    index: int
    """Where the option token is in argv."""
    value: str | None
    inline: bool
    """True for ``--flag=value`` (value in the same token), False for ``--flag value``."""


def _resolve(name: str) -> str | None:
    """The canonical spelling of a long option, allowing unique prefixes as argparse does."""
    if name in VALUE_OPTIONS or name in FLAG_OPTIONS:
        return name
    if not name.startswith("--"):
        return None
    matches = {s for s in (*VALUE_OPTIONS, *FLAG_OPTIONS) if s.startswith(name)}
    dests = {VALUE_OPTIONS.get(s) or FLAG_OPTIONS[s] for s in matches}
    return min(matches) if len(dests) == 1 else None


def _scan(argv: Sequence[str]) -> tuple[list[_Option], int]:
    """torchrun's options in ``argv`` and the index where they end (the script or ``--``)."""
    options: list[_Option] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-") or token == "-":
            return options, i
        name, has_value, value = token.partition("=")
        spelling = _resolve(name)
        if spelling is None and not token.startswith("--") and token[:2] in VALUE_OPTIONS:
            options.append(_Option(VALUE_OPTIONS[token[:2]], i, token[2:], True))  # -r3
            i += 1
            continue
        if spelling in VALUE_OPTIONS:
            dest = VALUE_OPTIONS[spelling]
            if has_value:
                options.append(_Option(dest, i, value, True))
                i += 1
            else:
                options.append(_Option(dest, i, argv[i + 1] if i + 1 < len(argv) else None,
                                       False))
                i += 2
            continue
        if spelling in FLAG_OPTIONS:
            options.append(_Option(FLAG_OPTIONS[spelling], i, None, False))
        i += 1  # an unknown option: torchrun reports it
    return options, len(argv)


def _last(options: Sequence[_Option], dest: str) -> _Option | None:
    found = [o for o in options if o.dest == dest]
    return found[-1] if found else None


def conf_keys(conf: str) -> set[str]:
    """The keys of a ``--rdzv-conf`` string ``k1=v1,k2=v2`` (as torchrun splits it)."""
    return {part.split("=", 1)[0].strip() for part in conf.split(",") if part.strip()}


@dataclass(frozen=True)
class _Setting:
    """A value torchrun will read: from the command line (last wins) or its ``PET_*`` default."""

    value: str
    name: str
    """How the user wrote it, for messages: ``--nproc_per_node`` or ``PET_NPROC_PER_NODE``."""


def _setting(argv: Sequence[str], options: Sequence[_Option], env: Mapping[str, str],
             dest: str) -> _Setting | None:
    opt = _last(options, dest)
    if opt is not None:
        # a missing value (the option ends argv) is left to torchrun, which reports it
        return None if opt.value is None else _Setting(opt.value,
                                                       argv[opt.index].partition("=")[0])
    env_name = f"PET_{dest.upper()}"
    return _Setting(env[env_name], env_name) if env.get(env_name) else None


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host[:port]`` or ``[v6]:port`` as torchrun reads an endpoint (default port 29400);
    ValueError if the port is not a TCP port."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # no port, or a bare IPv6 address
        host, port_text = text, ""
    if not port_text:
        return host, DEFAULT_RDZV_PORT
    port = _int(port_text)
    if port is None or not 0 < port < 65536:
        raise ValueError(f"the port {port_text!r} must be an integer in 1..65535")
    return host, port


def _check(argv: Sequence[str], options: Sequence[_Option], env: Mapping[str, str]) -> None:
    """Raise LaunchArgsError for a value torchrun would only reject with a traceback."""
    nproc = _setting(argv, options, env, "nproc_per_node")
    if nproc is not None and nproc.value not in NPROC_WORDS:
        count = _int(nproc.value)
        if count is None or count < 1:
            raise LaunchArgsError(f"{nproc.name} {nproc.value} is not valid: it must be a "
                                  f"positive integer or one of {', '.join(NPROC_WORDS)}")
    nnodes = _setting(argv, options, env, "nnodes")
    if nnodes is not None:
        bounds = [_int(part) for part in nnodes.value.split(":")]
        low, high = (bounds[0], bounds[-1]) if len(bounds) in (1, 2) else (None, None)
        if low is None or high is None or not 0 < low <= high:
            raise LaunchArgsError(f"{nnodes.name} {nnodes.value} is not valid: it must be N or "
                                  "MIN:MAX with integers 1 <= MIN <= MAX")
    restarts = _setting(argv, options, env, "max_restarts")
    if restarts is not None:
        count = _int(restarts.value)
        if count is None or count < 0:
            raise LaunchArgsError(f"{restarts.name} {restarts.value} is not valid: it must be "
                                  "an integer >= 0")
    interval = _setting(argv, options, env, "monitor_interval")
    if interval is not None:
        try:
            seconds = float(interval.value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise LaunchArgsError(f"{interval.name} {interval.value} is not valid: it must be "
                                  "a positive number of seconds")
    endpoint = _setting(argv, options, env, "rdzv_endpoint")
    if endpoint is not None:
        try:
            split_endpoint(endpoint.value)
        except ValueError as error:
            raise LaunchArgsError(f"{endpoint.name} {endpoint.value} is not valid: "
                                  f"{error}") from None


def _exit_barrier_timeout(env: Mapping[str, str]) -> float | None:
    """The user's ``CANNIKIN_EXIT_BARRIER_TIMEOUT_S``, None if unset; LaunchArgsError if it is
    not a number of seconds >= 0."""
    raw = env.get(EXIT_BARRIER_ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise LaunchArgsError(f"{EXIT_BARRIER_ENV}={raw} is not valid: it must be a number of "
                              "seconds >= 0")
    return seconds


def with_cannikin_defaults(argv: Sequence[str], env: Mapping[str, str],
                           probe: EndpointProbe | None = None) -> LaunchArgs:
    """``argv`` (torchrun's arguments) with Cannikin's defaults where the user set none.

    ``env`` is the launcher's environment: it tells which ``PET_*`` defaults torchrun will
    read and whether the user already set the store variable. ``probe`` looks the c10d
    endpoint up from this host; without it no cross-host default is added (the rewrite stays
    pure). Nothing is removed or reordered; at most one ``--rdzv-conf`` value is changed or
    one ``--rdzv-conf=...`` inserted, and one ``--local-addr=...`` inserted, just before the
    training script. LaunchArgsError for a value torchrun would reject with a traceback, or for
    a ``CANNIKIN_EXIT_BARRIER_TIMEOUT_S`` that is not a number of seconds >= 0.
    """
    argv = list(argv)
    options, end = _scan(argv)
    helping = _last(options, "help") is not None  # torchrun prints its help, whatever the values
    if not helping:
        _check(argv, options, env)
    exit_barrier_s = None if helping else _exit_barrier_timeout(env)
    standalone_opt = _last(options, "standalone")
    standalone = standalone_opt is not None or env.get("PET_STANDALONE", "0") not in ("", "0")
    backend_opt = _last(options, "rdzv_backend")
    backend = backend_opt.value if backend_opt is not None else env.get("PET_RDZV_BACKEND")
    added: list[str] = []
    inserted: list[str] = []
    if backend == "c10d" and not standalone:
        conf_opt = _last(options, "rdzv_conf")
        conf = (conf_opt.value if conf_opt is not None else env.get("PET_RDZV_CONF")) or ""
        missing_value = conf_opt is not None and conf_opt.value is None  # torchrun reports it
        keys = conf_keys(conf)
        extras = [f"{key}={value}" for group in RDZV_CONF_DEFAULTS if not keys & group.keys()
                  for key, value in group.items()]
        endpoint = _setting(argv, options, env, "rdzv_endpoint")
        view = None
        if probe is not None and endpoint is not None and not helping:
            host, port = split_endpoint(endpoint.value)
            view = None if not host or is_loopback(host) else probe(host, port)
        if view is not None:
            if view.owned and not view.served and "is_host" not in keys:
                extras.append("is_host=1")
            if _setting(argv, options, env, "local_addr") is None:
                inserted.append(f"--local-addr={view.local_addr}")
                added.append(f"--local-addr {view.local_addr}")
        if extras and not missing_value:
            extra = ",".join(extras)
            merged = f"{conf.rstrip().rstrip(',')},{extra}" if conf.strip() else extra
            if conf_opt is None:
                inserted.insert(0, f"--rdzv-conf={merged}")
            elif conf_opt.inline:
                argv[conf_opt.index] = f"{argv[conf_opt.index].partition('=')[0]}={merged}"
            else:
                argv[conf_opt.index + 1] = merged
            added.insert(0, f"--rdzv-conf {extra}")
    argv[end:end] = inserted
    extra_env = {}
    if SHARE_STORE_ENV not in env:
        extra_env[SHARE_STORE_ENV] = "1"
        added.append(f"{SHARE_STORE_ENV}=1")
    if exit_barrier_s is None:
        exit_barrier_s = DEFAULT_EXIT_BARRIER_TIMEOUT_S
        added.append(f"exit barrier {exit_barrier_s:g} s")
    return LaunchArgs(argv=tuple(argv), env=extra_env, added=tuple(added),
                      exit_barrier_timeout_s=exit_barrier_s)
