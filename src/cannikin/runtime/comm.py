"""The weighted gradient all-reduce: exact mean gradient over uneven local batches.

Worker i computes the gradient g_i of its *local mean* loss over b_i samples. The
mean-loss gradient over all B = sum_i b_i samples is sum_i (b_i / B) g_i, so each
bucket is scaled by b_i / B and all-reduced with a *sum* (DESIGN.md §5). Plain DDP
averages (1/n) sum_i g_i, which is wrong whenever the b_i differ.

DDP calls the hook once per bucket, in the order buckets become ready, and rebuilds
its buckets after the first step; the per-step weight therefore lives in the shared
:class:`CommState`, not in any per-bucket closure. The hook also takes the marks the
profiler needs (bucket ready, all-reduce done) and, before scaling, the local squared
gradient norm |g_i|^2 for the noise-scale estimate.

The per-step exchange of measurements (a few hundred bytes per rank, zeros outside this
rank's row, so a sum is an all-gather) rides at the tail of the step's smallest bucket: on
gloo a collective costs far more than its bytes (every ring round is a wake-up of each
rank), and the bucket is written once anyway when it is scaled. float64 rows travel as
(hi, lo) float32 pairs in a float32 bucket, so they arrive to ~1e-14; a bucket of another
dtype (fp16, bf16) cannot carry them and they go in a small collective of their own.

Nothing of Python may be left for the backend's worker thread to destroy. That thread
finishes each collective, and anything Python it drops takes the GIL; once the main thread
has begun interpreter finalisation, ``take_gil`` ends the thread with ``pthread_exit``, whose
forced unwind through a noexcept C++ destructor aborts the process (``terminate called
without an active exception``) after the training finished. Two things did that: a
``.then`` callback on the collective's future (the worker thread completes the child future
DDP waits on *before* it destroys the callback), and the ``contextvars.Context`` that torch
keeps in the backward's thread-local state, which every collective launched from the
backward copies into its work (:func:`_launch_unstashed`). So the hook launches
its all-reduces without that context and hands DDP a future of its own, which a
:class:`_Finisher` thread completes (a plain non-daemon Python thread, which the
interpreter joins before it finalises) on a step that measures the reduced gradient, and
the last bucket's hook completes on any other step (:func:`_complete_at_last_bucket`).
"""

# No `from __future__ import annotations`: DDP checks the hook signature at run time.

import math
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # what DDP's hook annotation must name

from cannikin.runtime.routes import Route

# (param, grad) -> gradient in the space the noise scale is measured in
GradTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(kw_only=True)
class CommState:
    """Shared state of the weighted all-reduce hook; one per wrapped model.

    ``weight`` is b_i / B for the current step (set before each backward).
    ``transform`` maps a gradient into the space the noise scale is measured in (None: the
    identity, one dot product per bucket). The hook takes the local |g_i|^2 before the
    all-reduce and the global |g|^2 from the reduced bucket, both through ``transform``,
    so the two are in the same space even under a scaled loss (AMP's GradScaler unscales
    the gradients only before the optimizer step). The ``ready``/``done`` lists and squared
    norms are this step's records, cleared by :meth:`begin_step`.
    """

    clock: Any
    group: dist.ProcessGroup | None = None
    weight: float = 1.0
    transform: GradTransform | None = None
    capture_sqnorm: bool = True
    times_buckets: bool = True
    """Mark when each bucket's all-reduce is done (the communication model's samples), as
    a step that takes norms does. HeteroDataParallel sets it on every measured step: tied
    to the norms (every 8th step where the noise scale decides nothing), the all-reduce
    with every worker busy had 3-5 samples in 300 steps on quota workers whose slowest was
    held at 0, the earliest of them from a cold process, and the model put the even split
    up to 25% high (47 ms of all-reduce where 20-30 were measured in other runs)."""
    takes_global: bool = True
    """Take |g|^2 of the all-reduced buckets here (with ``capture_sqnorm``). The reduced
    gradient is the same on every rank, so HeteroDataParallel has one rank take it (the
    one with the step's largest local batch) and the exchange tell the others: on each
    of the others it was a pass over the whole gradient on every step that takes norms."""
    seeded: bool = False
    """The backward running was seeded with ``weight`` (HeteroDataParallel.backward): the
    buckets already hold b_i / B times the local gradient, and the hook does not scale them."""
    sqnorm_scale: float = 1.0
    """The local mean gradient over the bucket's: its |g_i|^2 is this squared times the
    bucket's (not 1 when the bucket holds passes accumulated, see ``begin_pass``)."""
    ready: list[Any] = field(default_factory=list)
    done: list[Any] = field(default_factory=list)
    local_parts: list[torch.Tensor] = field(default_factory=list)
    global_parts: list[torch.Tensor] = field(default_factory=list)
    pass_parts: list[list[torch.Tensor]] = field(default_factory=list)
    """Per micro-batch of a step in several passes: its own gradient's |g|^2 parts, taken
    by hooks on the parameters (:meth:`watch_passes`); empty when not watched."""
    output_grad: torch.Tensor | None = None
    """The loss check's figure of this step (:attr:`StepReport.output_grad`), a 0-dim tensor
    where the device holds it until :meth:`read_step`; None where not taken."""
    pass_index: int = 0
    """The micro-batch whose backward is running."""
    pass_hooks: list[Any] = field(default_factory=list)
    route: Route | None = None
    """This step's route where some workers have no samples (:mod:`cannikin.runtime.routes`):
    the busy ones all-reduce, the source broadcasts the sum to the idle ones, and ``rows``
    travel in a collective of their own over every rank. None: every bucket is all-reduced
    over ``group``."""
    rows: np.ndarray | None = None
    """Per-step exchange (float64) to sum over ranks, sent with bucket ``carrier_slot``, or
    with the last bucket under ``rows_at_last``."""
    rows_at_last: bool = False
    """Send ``rows`` with the last bucket, whose all-reduce is the backward's last (DDP
    launches them in index order): a rank whose backward fails before it can still tell
    every rank (:func:`finish_failed_backward`). Against the smallest bucket, the default:
    the kept :attr:`carrier` is the last bucket's size, and where the gradients are views of
    DDP's buckets (``gradient_as_bucket_view``) DDP copies the last bucket back from it
    instead of the smallest."""
    rows_tail: torch.Tensor | None = None
    """The summed ``rows``, encoded, at the tail of the reduced carrier bucket."""
    rows_alone: tuple[torch.Tensor, dist.Work] | None = None
    """``rows`` in an all-reduce of their own (when the carrier's dtype cannot carry them)."""
    sizes: list[int] = field(default_factory=list)
    """This step's bucket sizes, in the order DDP hands them over (its index order)."""
    carrier_slot: int = 0
    """The bucket that carries ``rows``: the smallest of the previous step's (DDP's bucket
    layout is the same on every rank, so every rank chooses the same one)."""
    carrier: torch.Tensor | None = None
    """The carrier bucket and ``rows`` side by side, kept from step to step (a fresh tensor
    of a bucket's size costs page faults on every step); DDP has copied the reduced head
    into the gradients before the next backward writes it again."""
    reductions: list["_Reduction"] = field(default_factory=list)
    """This step's bucket all-reduces launched so far, in launch order."""
    backwards: int = 0
    """This step's backwards that reached DDP's all-reduce (its last bucket's hook ran): more
    than one (a GAN's discriminator on real and then fake samples) leaves the records above
    doubled, and the step says nothing of one backward's time or norms."""
    unfinished: list["_Reduction"] = field(default_factory=list)
    """This step's all-reduces that the last bucket's hook completes (unmeasured buckets)."""
    finisher: "_Finisher | None" = None
    """Completes the all-reduces in flight (made at the first bucket: it needs the device)."""
    stream: torch.cuda.Stream | None = None
    """See :meth:`side_stream`."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"weight must be b_i/B in [0, 1], got {self.weight}")

    def begin_step(self, weight: float) -> None:
        """Set this step's weight b_i / B and clear the per-step records."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight must be b_i/B in [0, 1], got {weight}")
        self.weight = weight
        if self.sizes:
            self.carrier_slot = min(range(len(self.sizes)), key=self.sizes.__getitem__)
        self.sizes = []
        self.ready = []
        self.done = []
        self.local_parts = []
        self.global_parts = []
        self.output_grad = None
        self.rows = None
        self.rows_tail = None
        self.rows_alone = None
        self.reductions = []
        self.unfinished = []
        self.backwards = 0

    def read_step(self, norms: bool) -> "StepReadout":
        """What this step's collectives left on the device, read in one transfer: the
        exchange ``rows`` summed over ranks (None if they were not sent) and, with
        ``norms``, |g_i|^2 of the local gradient (0.0 if no bucket was seen), |g|^2 of the
        all-reduced one (None if the hook did not take it here), the loss check's
        :attr:`output_grad` (0.0 where not taken) and each watched micro-batch's |g|^2. On a
        GPU that is the step's one host synchronisation, not one per part (with Adam a part
        is a parameter) and another for the rows."""
        groups: list[list[torch.Tensor]] = []
        measured = False
        if norms:
            measured = self.capture_sqnorm and bool(self.global_parts)
            output_parts = [] if self.output_grad is None else [self.output_grad]
            groups = [self.local_parts, self.global_parts if measured else [], output_parts,
                      *self.pass_parts]
        rows, encoded = None, False
        if self.rows is not None and self.rows_alone is not None:
            rows, work = self.rows_alone
            work.wait()
        elif self.rows is not None and self.rows_tail is not None:
            rows, encoded = self.rows_tail, self.rows_tail.dtype == torch.float32
        device = next((t.device for t in (rows, *(p for g in groups for p in g))
                       if t is not None), torch.device("cpu"))
        sums = [_total(group, device) for group in groups]
        if device.type == "cpu":  # nothing to transfer: read in place
            totals = [float(t) for t in sums]
            tail = None if rows is None else rows.numpy()
        else:
            flat = sums if rows is None else [*sums, rows.to(dtype=torch.float64)]
            host = torch.cat([t.reshape(-1) for t in flat]).cpu().numpy()
            totals, tail = host[:len(groups)].tolist(), host[len(groups):]
        readout = StepReadout()
        if tail is not None and self.rows is not None:
            summed = decode_rows(tail.astype(np.float32)) if encoded else tail.copy()
            readout.rows = summed.reshape(self.rows.shape)
        if norms:
            local, global_, output, *passes = totals
            readout.local_sqnorm = local * self.sqnorm_scale ** 2
            readout.global_sqnorm = global_ if measured else None
            readout.output_grad = output if math.isfinite(output) else 0.0
            readout.pass_sqnorms = tuple(passes)
        return readout

    def watch_passes(self, params: list[torch.Tensor], count: int) -> None:
        """Take each of a step's ``count`` micro-batches' own |g|^2 (through ``transform``)
        from its gradients as the backward produces them, before they accumulate: the
        noise scale's gradient groups. Until :meth:`unwatch_passes`."""
        self.unwatch_passes()
        self.pass_parts = [[] for _ in range(count)]
        self.pass_index = 0
        self.pass_hooks = [p.register_hook(self._pass_hook(p))  # type: ignore[no-untyped-call]
                           for p in params if p.requires_grad]

    def unwatch_passes(self) -> None:
        for handle in self.pass_hooks:
            handle.remove()
        self.pass_hooks, self.pass_parts = [], []

    def _pass_hook(self, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def record(grad: torch.Tensor) -> None:
            part = grad if self.transform is None else self.transform(param, grad)
            self.pass_parts[self.pass_index].append(_sqnorm(part.detach().reshape(-1)))
        return record

    def side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """A CUDA stream of this state's own on ``device`` (None on CPU): the all-reduces
        are waited for on it, so a mark there times the collective, not the backward."""
        if device.type != "cuda":
            return None
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self.stream

    def carrier_for(self, bucket: torch.Tensor, extra: int) -> torch.Tensor:
        """A flat tensor like ``bucket`` with ``extra`` more elements (:attr:`carrier`)."""
        size = bucket.numel() + extra
        carrier = self.carrier
        if (carrier is None or carrier.numel() != size or carrier.dtype != bucket.dtype
                or carrier.device != bucket.device):
            carrier = self.carrier = bucket.new_empty(size)
        return carrier

    def _add_local(self, bucket: GradBucket) -> None:
        # a seeded bucket holds weight x the local gradient (transform is linear in it)
        scale = self.weight ** -2 if self.seeded else 1.0
        self._add_sqnorm(self.local_parts, bucket, bucket.buffer(), scale)

    def _add_global(self, bucket: GradBucket, reduced: torch.Tensor) -> None:
        self._add_sqnorm(self.global_parts, bucket, reduced)

    def _add_sqnorm(self, parts: list[torch.Tensor], bucket: GradBucket,
                    flat: torch.Tensor, scale: float = 1.0) -> None:
        """``scale`` |transform(flat)|^2 into ``parts``; ``flat`` is laid out as the bucket's
        buffer (each gradient a view of it, found by its offset)."""
        if self.transform is None:
            found = [_sqnorm(flat)]
        else:
            found = [_sqnorm(self.transform(param, part).detach().reshape(-1))
                     for param, part in _gradient_views(bucket, flat)]
        parts.extend(found if scale == 1.0 else [part * scale for part in found])


@dataclass
class StepReadout:
    """:meth:`CommState.read_step`'s values, on the host."""

    rows: np.ndarray | None = None
    local_sqnorm: float = math.nan
    global_sqnorm: float | None = None
    pass_sqnorms: tuple[float, ...] = ()
    output_grad: float = 0.0


def encoded_size(rows: np.ndarray, dtype: torch.dtype) -> int | None:
    """Elements :func:`encode_rows` needs in a bucket of ``dtype``, or None when ``dtype``
    cannot carry float64 ``rows`` (fp16, bf16, integers)."""
    if dtype == torch.float64:
        return rows.size
    return 2 * rows.size if dtype == torch.float32 else None


def encode_rows(rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write float64 ``rows`` into ``out`` (:func:`encoded_size` elements of the bucket's
    dtype) so that the sum of every rank's ``out`` decodes to the sum of their rows; return
    ``out``. A sum of zeros and one rank's value is exact in any dtype, so the float32
    (hi, lo) split loses only lo's rounding; a value beyond float32's range travels as NaN.
    numpy, written in place: a few hundred values, where torch's per-op cost and a fresh
    array would dominate."""
    flat = rows.reshape(-1)
    if out.dtype == np.float64:
        out[:] = flat
        return out
    beyond = np.abs(flat) > _FLOAT32_MAX  # False for a NaN, which travels as NaN anyway
    if beyond.any():
        flat = np.where(beyond, np.nan, flat)
    hi, lo = out[:flat.size], out[flat.size:]
    hi[:] = flat
    np.subtract(flat, hi, out=lo, casting="same_kind")
    return out


def decode_rows(encoded: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_rows` (a new float64 array, flat)."""
    if encoded.dtype == np.float64:
        return encoded.copy()
    wide = encoded.astype(np.float64)
    half = wide.size // 2
    return wide[:half] + wide[half:]


def weighted_allreduce_hook(
    state: CommState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Scale the bucket by b_i / B (unless a seeded backward did, ``state.seeded``) and
    all-reduce it with a sum.

    A worker with b_i = 0 contributes zeros. ``state.rows`` travels at the tail of
    bucket ``state.carrier_slot`` (see the module docstring), or of the last bucket under
    ``state.rows_at_last``; that bucket is scaled into
    :attr:`CommState.carrier` instead of in place, and DDP copies the reduced head into
    the gradients as it does for any hook's result.
    """
    state.ready.append(state.clock.mark())
    if state.capture_sqnorm and state.weight > 0.0:
        state._add_local(bucket)
    buffer = bucket.buffer()
    slot = len(state.done)
    state.done.append(None)
    state.sizes.append(buffer.numel())
    carries = bucket.is_last() if state.rows_at_last else slot == state.carrier_slot
    rows = state.rows if carries else None
    route = state.route
    extra = None if rows is None or route is not None else encoded_size(rows, buffer.dtype)
    size = buffer.numel()
    factor = 1.0 if state.seeded else state.weight
    fan_out = None
    if route is not None and route.busy is None:  # idle here: the source's sum lands in it
        send = buffer
        work = _launch_unstashed(send, route.fan, route.source)
    else:
        if rows is None or extra is None:
            send = _scaled(buffer, factor, out=buffer)
        else:
            send = state.carrier_for(buffer, extra)
            _scaled(buffer, factor, out=send[:size])
            _write_rows(rows, send[size:])
        work = _launch_unstashed(send, state.group if route is None else route.busy)
        fan_out = route if route is not None and route.fan is not None else None
    if rows is not None and extra is None:
        alone = _write_rows(rows, torch.empty(rows.size, dtype=torch.float64,
                                              device=buffer.device))
        state.rows_alone = (alone, _launch_unstashed(alone, state.group))
    if bucket.is_last():
        state.backwards += 1
    reduction = _Reduction(slot=slot, bucket=bucket, sent=send, size=size,
                           carries_rows=extra is not None, norms=state.capture_sqnorm,
                           timed=state.capture_sqnorm or state.times_buckets, work=work,
                           fan_out=fan_out)
    state.reductions.append(reduction)
    if not reduction.timed:
        return _complete_at_last_bucket(state, reduction, bucket.is_last())
    if state.finisher is None:
        state.finisher = _Finisher(state, buffer.device)
    return state.finisher.add(reduction)


@dataclass(kw_only=True)
class _Reduction:
    """One bucket's all-reduce in flight."""

    slot: int
    bucket: GradBucket
    sent: torch.Tensor
    """What is all-reduced: the bucket's buffer, or the carrier (the bucket, then rows)."""
    size: int
    """The bucket's elements: the head of ``sent`` that goes back to DDP."""
    carries_rows: bool
    norms: bool
    """Take |g|^2 of the result (where the state takes the global norm)."""
    timed: bool
    """Mark when it is done (on the finisher thread: the wait is in launch order there)."""
    work: dist.Work
    fan_out: Route | None
    """This rank is the route's source: once ``work`` is done, it broadcasts the sum to
    the idle workers."""
    result: torch.futures.Future[torch.Tensor] = field(init=False)
    """What DDP waits on."""


class _Finisher:
    """Completes the hook's all-reduces on a thread of its own, in launch order.

    For each bucket it waits for the all-reduce, marks when it was done, takes |g|^2 of the
    reduced bucket, picks out the exchange rows and completes the future DDP waits on (a
    failed all-reduce completes it with an error naming the rank). All of it happens before
    DDP copies the result into the gradients, so nothing the user does after the backward
    (AMP's unscaling) can race it. One thread per wrapped model, kept from step to step:
    starting one per backward cost ~5 ms of wall time per step on a worker held to a
    quarter of a core. It is not a daemon, so the interpreter joins it before finalising
    (the module docstring says why no callback runs on the backend's own thread), and it
    ends once the main thread has ended or the state is gone.
    """

    POLL_S = 0.1
    """How often the idle thread checks that the main thread and the state still live: the
    longest it can delay the end of the interpreter."""

    def __init__(self, state: CommState, device: torch.device) -> None:
        self._state = weakref.ref(state)
        self._queue: queue.SimpleQueue[_Reduction] = queue.SimpleQueue()
        self._stream = state.side_stream(device)
        self._devices: list[int | str | torch.device] | None = (
            None if self._stream is None else [device])
        self._thread: threading.Thread | None = None

    def add(self, reduction: _Reduction) -> torch.futures.Future[torch.Tensor]:
        """Queue ``reduction``; the future DDP waits on for it.

        That is a ``.then`` of the future this thread completes, so that a failure reaches
        DDP as an error it raises from the backward: DDP reads a Python future's value
        without the unwrapping that makes ``set_exception`` raise. The callback runs, and
        is dropped, on this thread when it completes the future."""
        reduction.result = torch.futures.Future(devices=self._devices)
        outcome: torch.futures.Future[torch.Tensor] = reduction.result.then(_result_or_raise)
        if self._thread is None or not self._thread.is_alive():  # first use, or forked
            self._thread = threading.Thread(target=self._run, name="cannikin-allreduce",
                                            args=(torch.get_num_threads(),), daemon=False)
            self._thread.start()
        self._queue.put(reduction)
        return outcome

    def _run(self, threads: int) -> None:
        """``threads``: the launching thread's intra-op thread count. OpenMP keeps it per
        thread, and a new thread starts at the machine's cores unless OMP_NUM_THREADS says
        otherwise: the norms taken here would wake an OpenMP pool whose spinning workers
        cost more CPU than the step's whole runtime (~1.5 ms per step at full speed
        against 0.05 ms with one thread)."""
        torch.set_num_threads(threads)
        main = threading.main_thread()
        while True:
            try:
                reduction = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                if not main.is_alive() or self._state() is None:
                    return
                continue
            state = self._state()
            try:
                if state is None:
                    raise RuntimeError("the all-reduce hook's state is gone")
                if self._stream is None:
                    _finish(state, reduction)
                else:
                    with torch.cuda.stream(self._stream):  # waits for the collective only
                        _finish(state, reduction)
            except Exception as error:  # every future must complete: DDP waits on it
                reduction.result.set_exception(error)  # type: ignore[arg-type]  # typed as T
            del state, reduction


def _finish(state: CommState, reduction: _Reduction) -> None:
    """Wait for ``reduction``'s all-reduce (and, on a route's source, broadcast the sum),
    take what the step measures of it, and complete the future DDP waits on with the
    reduced bucket."""
    _wait(state, reduction.work)
    reduced = reduction.sent[:reduction.size]
    if reduction.fan_out is not None:
        route = reduction.fan_out
        _wait(state, _launch_unstashed(reduced, route.fan, route.source))
    if reduction.timed:
        state.done[reduction.slot] = state.clock.mark()
    if reduction.carries_rows:
        state.rows_tail = reduction.sent[reduction.size:]
    if reduction.norms and state.takes_global:
        state._add_global(reduction.bucket, reduced)
    reduction.result.set_result(reduced)


def _wait(state: CommState, work: dist.Work) -> None:
    """Wait for one of the gradient's collectives (the all-reduce, or the idle route's
    broadcast: the message names the all-reduce either way); a timeout raises naming this
    rank."""
    try:
        work.wait()
    except RuntimeError as error:  # gloo/nccl: the process group's timeout ran out
        raise RuntimeError(
            f"rank {dist.get_rank(state.group)} of {dist.get_world_size(state.group)}: "
            f"gradient all-reduce failed (a peer worker may be hung or dead; the wait is "
            f"bounded by the collective timeout, docs/reliability.md): {error}") from error


def _complete_at_last_bucket(state: CommState, reduction: _Reduction,
                             last: bool) -> torch.futures.Future[torch.Tensor]:
    """A bucket of a step that takes no marks or norms when its all-reduce is done: no
    thread is woken for it. The last bucket's hook waits for the step's all-reduces in
    launch order and completes their futures, which is where DDP would wait for them
    anyway; a failure raises from that hook, so from ``backward()``. On a worker held to
    a fraction of a core the finisher's two wake-ups per bucket cost CPU it does not have.
    """
    devices: list[int | str | torch.device] | None = (
        None if reduction.sent.device.type == "cpu" else [reduction.sent.device])
    reduction.result = torch.futures.Future(devices=devices)
    state.unfinished.append(reduction)
    if last:
        pending, state.unfinished = state.unfinished, []
        for index, waiting in enumerate(pending):
            try:
                _finish(state, waiting)
            except Exception as error:
                for left in pending[index:]:  # nobody may wait on them forever
                    left.result.set_exception(error)  # type: ignore[arg-type]  # typed as T
                raise
    return reduction.result


def finish_failed_backward(state: CommState, buckets: list[GradBucket]) -> None:
    """This rank's backward failed after launching the all-reduces of its first
    ``len(state.reductions)`` buckets, while every peer's backward launches all of them and
    waits. Launch the others through the hook, from ``buckets`` (DDP's bucket layout, in
    index order, zero-filled: its reducer's ``_get_zeros_like_grad_buckets()``), so that
    every collective lines up and ``state.rows`` (set to say so) travel with the last one
    (``state.rows_at_last``); wait for them all; and give every parameter the reduced
    gradient the peers get, so that a decision taken on it (AMP's GradScaler skipping an
    overflowed step) is the same on every rank. The last bucket must not have been launched
    (its rows said nothing of the failure)."""
    futures = [weighted_allreduce_hook(state, bucket)
               for bucket in buckets[len(state.reductions):]]
    for future in futures:
        future.wait()
    with torch.no_grad():
        for reduction in state.reductions:
            reduced = reduction.sent[:reduction.size]
            for param, part in _gradient_views(reduction.bucket, reduced):
                if param.grad is None:
                    param.grad = part.clone()
                else:
                    param.grad.copy_(part)


def _gradient_views(bucket: GradBucket,
                    flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter of ``bucket`` with the view of ``flat`` (laid out as the bucket's
    buffer) that holds its gradient, found by the gradient's offset in the buffer."""
    base, size = bucket.buffer().data_ptr(), flat.element_size()
    views = []
    for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
        start = (grad.data_ptr() - base) // size
        views.append((param, flat[start:start + grad.numel()].view(grad.shape)))
    return views


def _result_or_raise(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    """The reduced bucket, or the error the finisher completed ``future`` with, raised."""
    return future.wait()


_BACKWARD_CONTEXT = "context"
"""The key under which torch's ``_engine_run_backward`` keeps a ``contextvars.Context`` in
the thread-local state for the whole backward (torch 2.13 does; older ones may not)."""


_STASHES_CONTEXT = hasattr(torch._C, "_is_key_in_tls")


def _launch_unstashed(tensor: torch.Tensor, group: dist.ProcessGroup | None,
                      source: int | None = None) -> dist.Work:
    """Launch :func:`_launch`'s collective of ``tensor`` without the Python object torch keeps
    in the backward's thread-local state. A collective copies the launching thread's
    thread-local state into its work; the backend thread that destroys the finished work
    then drops that Python object, which takes the GIL: after interpreter finalisation has
    begun, that ends the backend thread inside a noexcept destructor and aborts the process
    (seen here in 5 of 40 workers that exited right after a backward, on torch 2.13). A
    plain function, not a context manager: it runs once per bucket on the slowest worker's
    critical path, and so it launches on the process group itself: torch.distributed's
    checks around the same call cost ~0.04 ms of CPU per bucket (two gloo ranks, in the
    hook). A complex bucket goes through torch.distributed, which reduces it as real pairs."""
    if not (_STASHES_CONTEXT and torch._C._is_key_in_tls(_BACKWARD_CONTEXT)):
        return _launch(tensor, group, source)
    context = torch._C._get_obj_in_tls(_BACKWARD_CONTEXT)
    torch._C._remove_obj_from_tls(_BACKWARD_CONTEXT)
    try:
        return _launch(tensor, group, source)
    finally:
        torch._C._stash_obj_in_tls(_BACKWARD_CONTEXT, context)


def _launch(tensor: torch.Tensor, group: dist.ProcessGroup | None,
            source: int | None = None) -> dist.Work:
    """An async sum all-reduce of ``tensor`` on ``group`` (None: the default group), or
    with a ``source`` (a global rank) its broadcast from there."""
    work: dist.Work
    pg = dist.group.WORLD if group is None else group
    if source is not None:
        work = dist.broadcast(tensor, src=source, group=group, async_op=True)
    elif pg is None or tensor.is_complex():  # torch.distributed's error, or its real pairs
        work = dist.all_reduce(tensor, group=group, async_op=True)
    else:
        work = pg.allreduce([tensor])
    return work


def _write_rows(rows: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """Encode ``rows`` into ``out`` (the carrier's tail, or a float64 tensor of their own)
    and return it: in place on the host; on a GPU through pinned memory (torch's caching
    host allocator keeps the block until the copy is done), since a copy from pageable
    memory makes the host wait for the stream, mid-backward."""
    if out.device.type == "cpu":
        encode_rows(rows, out.numpy())
        return out
    staging = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    encode_rows(rows, staging.numpy())
    return out.copy_(staging, non_blocking=True)


def _total(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of 0-dim ``parts`` as a 0-dim float64 tensor, without reading any of them."""
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    if len({part.dtype for part in parts}) > 1:
        parts = [part.double() for part in parts]
    return torch.stack(parts).sum(dtype=torch.float64)


def _sqnorm(flat: torch.Tensor) -> torch.Tensor:
    """|flat|^2 as a 0-dim float32 or float64 tensor (read with ``float()`` once the
    step's backward is done): a half-precision square overflows at |g| ~ 256."""
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat)
    norm: torch.Tensor = torch.linalg.vector_norm(flat, dtype=torch.float32)
    return norm.square()


def _scaled(buffer: torch.Tensor, weight: float, out: torch.Tensor) -> torch.Tensor:
    """``out = weight * buffer`` (``out`` may be ``buffer`` itself). A weight of 0 gives
    zeros rather than a product, so a NaN from an empty local batch cannot leak into the
    sum."""
    if weight == 0.0:
        out.zero_()
    elif weight != 1.0:
        torch.mul(buffer, weight, out=out)
    elif out is not buffer:
        out.copy_(buffer)
    return out
