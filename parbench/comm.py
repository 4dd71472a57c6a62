"""Instrumented collectives and the traffic ledger: one per process, every thread, every op.

``install()`` wraps, once per process, the public ``torch.distributed`` collective and
point-to-point functions and the functional collectives (``torch.distributed.
_functional_collectives``, which DTensor calls in forward and in its redistribute backward).
While a ``Ledger`` is active every call is recorded, whichever thread makes it (autograd runs
backward on device threads on CUDA, so gradient hooks issue collectives off the main thread)
and whoever makes it: our schemes, DeepSpeed (``deepspeed.comm`` forwards to these functions),
FSDP2, DTensor and ``torch.distributed.pipelining``. ``unrecorded()`` pauses recording for
traffic that is not the scheme's (checks, metrics, loss reporting).

What "wire bytes" assumes, per op, on a group of n ranks with an S-byte message (S: the full
message -- the reduced buffer, the *gathered* output, the full input of a reduce-scatter, one
rank's whole send buffer of an all-to-all; see ``parbench.analytic.comm``):

============================  =================================================================
all_reduce                    2(n-1)/n S (ring: reduce-scatter then all-gather)
all_gather, reduce_scatter    (n-1)/n S (ring)
all_to_all                    (n-1)/n S (each rank keeps its own block)
broadcast                     S on every rank but the last of the chain from the root, 0 there
reduce                        S on every rank but the root (chain towards the root), 0 there
gather                        S/n on every non-root rank, 0 on the root
scatter                       (n-1)/n S on the root, 0 elsewhere
send / recv                   S on the sender, 0 on the receiver (peer: the global rank)
barrier                       0
============================  =================================================================

Torch DDP's C++ reducer calls the process group directly; its baseline routes the buckets
through ``all_reduce`` in its checked steps only (``impls/baselines/torch_ddp``).
"""
from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from .analytic.comm import ROOTED, rooted_wire_factor, wire_factor

_LOCK = threading.Lock()
_ACTIVE: "Ledger | None" = None
_PAUSED = 0
_INSTALLED = False
_TLS = threading.local()  # per thread: inside a wrapped call (nested calls are not recorded)
#: called with a one-line description when a rank enters a collective and with "" when it
#: leaves (the launcher shows it when a case hangs)
_STATUS_SINK = None


@dataclass
class CommRecord:
    op: str
    axis: str
    group_size: int
    dtype: str
    elements: int
    message_bytes: int
    wire_bytes: float
    peer: int = -1
    start: float = 0.0
    end: float = 0.0
    async_op: bool = False
    thread: str = ""
    api: str = "c10d"  # c10d | functional


def record_wire(op: str, message_bytes: int, n: int, group_rank: int = 0,
                root: int | None = None) -> Fraction:
    """Bytes one rank sends for one recorded call, exact (``analytic.comm``)."""
    if op in ROOTED and root is not None:
        return rooted_wire_factor(op, n, group_rank, root) * message_bytes
    return wire_factor(op, n) * message_bytes


class Ledger:
    """The records of one rank. Use as a context manager around the code to account; while it
    is active, every thread's calls land here."""

    def __init__(self, axis_of=None, timeline=None, recording: bool = True):
        self.recording = recording  # False: entering it changes nothing (overhead baseline)
        self.records: list[CommRecord] = []
        self._exact: list[Fraction] = []  # each record's wire bytes, exact
        self._axis_of = axis_of  # callable(group) -> axis name
        self.timeline = timeline
        self._prev = None

    def __enter__(self) -> "Ledger":
        global _ACTIVE
        install()
        if self.recording:
            with _LOCK:
                self._prev, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        if self.recording:
            with _LOCK:
                _ACTIVE = self._prev

    def axis(self, group) -> str:
        if self._axis_of is not None:
            name = self._axis_of(group)
            if name:
                return name
        return "world" if group is None or group is dist.group.WORLD else "other"

    def add(self, rec: CommRecord, exact_wire: Fraction) -> None:
        with _LOCK:
            self.records.append(rec)
            self._exact.append(exact_wire)

    # ---- summaries ---------------------------------------------------------------------
    def wire_by_axis(self) -> dict[str, float]:
        """Exact per-axis sums (fractions of a byte from the ring factor are summed exactly
        before rounding to float, so equal totals compare equal)."""
        out: dict[str, Fraction] = defaultdict(Fraction)
        for r, w in zip(self.records, self._exact):
            out[r.axis] += w
        return {a: float(v) for a, v in out.items()}

    def calls_by_axis(self) -> dict[str, int]:
        """Calls per axis that move data (receives, barriers and collectives on a group of
        one rank not counted)."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            if r.op not in ("recv", "barrier") and r.group_size > 1:
                out[r.axis] += 1
        return dict(out)

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]


def active() -> Ledger | None:
    return None if _PAUSED else _ACTIVE


@contextmanager
def unrecorded():
    """Traffic that is not the scheme's (checks, metrics, loss reporting): not recorded, on
    any thread, while the block runs."""
    global _PAUSED
    with _LOCK:
        _PAUSED += 1
    try:
        yield
    finally:
        with _LOCK:
            _PAUSED -= 1


def set_status_sink(sink) -> None:
    """``sink(text)`` is told which collective this process is in ("" when it leaves)."""
    global _STATUS_SINK
    _STATUS_SINK = sink


# ---- the wrappers ---------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


@dataclass
class _Call:
    """What a wrapped call moves: its first tensor, message bytes, group, peer and root (both
    global ranks, or None)."""

    tensor: torch.Tensor
    message_bytes: int
    group: object
    peer: int | None = None
    root: int | None = None


def _record(op: str, call: _Call, work, t0: float, is_async: bool, api: str) -> None:
    led = active()
    if led is None:
        return
    group = call.group
    n = 2 if op in ("send", "recv") else _group_size(group)
    group_rank = dist.get_rank(group) if group is not None else dist.get_rank()
    root = None
    if call.root is not None and op in ROOTED:
        root = dist.get_group_rank(group, call.root) if group is not None else call.root
    wire = record_wire(op, call.message_bytes, n, group_rank, root)
    rec = CommRecord(op=op, axis=led.axis(group), group_size=n,
                     dtype=str(call.tensor.dtype).replace("torch.", ""),
                     elements=call.message_bytes // max(call.tensor.element_size(), 1),
                     message_bytes=call.message_bytes, wire_bytes=float(wire),
                     peer=-1 if call.peer is None else call.peer, start=t0,
                     end=time.perf_counter(), async_op=is_async,
                     thread=threading.current_thread().name, api=api)
    led.add(rec, wire)
    tl = led.timeline
    if work is not None and is_async and hasattr(work, "get_future"):
        try:
            fut = work.get_future()

            def _done(_f, rec=rec):
                rec.end = time.perf_counter()
                if tl is not None:
                    tl.add_comm(rec)

            fut.then(_done)
            return
        except Exception:  # backends without futures: issue time only
            pass
    if tl is not None:
        tl.add_comm(rec)


def _wrap(module, name: str, op: str, size_of, api: str = "c10d", sync_module=None) -> None:
    orig = getattr(module, name, None)
    if orig is None or getattr(orig, "_parbench_wrapped", False):
        return

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if getattr(_TLS, "inside", False) or (active() is None and _STATUS_SINK is None):
            # inside another wrapped call (blocking send calls isend): the outer call is the
            # one record
            return orig(*args, **kwargs)
        try:
            call = size_of(*args, **kwargs)
        except Exception:  # an argument form we do not know: run the call, record nothing
            return orig(*args, **kwargs)
        if call is None:  # the wrapped function forwards to wrapped calls: let them record
            return orig(*args, **kwargs)
        if _STATUS_SINK is not None:
            _STATUS_SINK(f"{op} ({api}) of {call.message_bytes} bytes on a group of "
                         f"{_group_size(call.group) if call.group is not None else '?'} ranks")
        t0 = time.perf_counter()
        _TLS.inside = True
        try:
            work = orig(*args, **kwargs)
        finally:
            _TLS.inside = False
            if _STATUS_SINK is not None:
                _STATUS_SINK("")
        is_async = bool(kwargs.get("async_op", False)) or name in ("isend", "irecv") \
            or api == "functional"
        _record(op, call, work, t0, is_async, api)
        return work

    wrapper._parbench_wrapped = True
    wrapper._parbench_orig = orig
    setattr(module, name, wrapper)
    if sync_module is not None and getattr(sync_module, name, None) is orig:
        setattr(sync_module, name, wrapper)


def _arg(args, kwargs, i, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _global_peer(group, peer, group_peer):
    """A peer given as a global rank, or as a rank inside ``group``, as a global rank."""
    if peer is not None:
        return peer
    if group_peer is None:
        return None
    return dist.get_global_rank(group, group_peer) if group is not None else group_peer


def _sum_bytes(tensors) -> int:
    return sum(_nbytes(t) for t in tensors)


# torch.distributed (c10d): argument positions follow torch 2.13's signatures


def _all_reduce(*a, **k):
    t = _arg(a, k, 0, "tensor")
    return _Call(t, _nbytes(t), _arg(a, k, 2, "group"))


def _all_gather_into(*a, **k):
    out = _arg(a, k, 0, "output_tensor")
    return _Call(out, _nbytes(out), _arg(a, k, 2, "group"))


def _all_gather_list(*a, **k):
    lst = _arg(a, k, 0, "tensor_list")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 2, "group"))


def _all_gather_coalesced(*a, **k):
    outs = _arg(a, k, 0, "output_tensor_lists")
    flat = [t for lst in outs for t in lst]
    return _Call(flat[0], _sum_bytes(flat), _arg(a, k, 2, "group"))


def _reduce_scatter_input(*a, **k):
    inp = _arg(a, k, 1, "input")
    return _Call(inp, _nbytes(inp), _arg(a, k, 3, "group"))


def _reduce_scatter_list(*a, **k):
    lst = _arg(a, k, 1, "input_list")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 3, "group"))


def _reduce(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 3, "group")
    return _Call(t, _nbytes(t), group,
                 root=_global_peer(group, _arg(a, k, 1, "dst"), k.get("group_dst")))


def _all_reduce_coalesced(*a, **k):
    lst = _arg(a, k, 0, "tensors")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 2, "group"))


def _all_to_all_single(*a, **k):
    inp = _arg(a, k, 1, "input")
    return _Call(inp, _nbytes(inp), _arg(a, k, 4, "group"))


def _all_to_all_list(*a, **k):
    lst = _arg(a, k, 1, "input_tensor_list")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 2, "group"))


def _broadcast(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 2, "group")
    return _Call(t, _nbytes(t), group,
                 root=_global_peer(group, _arg(a, k, 1, "src"), k.get("group_src")))


def _gather(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 3, "group")
    n = _group_size(group)
    return _Call(t, _nbytes(t) * n, group,
                 root=_global_peer(group, _arg(a, k, 2, "dst"), k.get("group_dst")))


def _scatter(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 3, "group")
    n = _group_size(group)
    return _Call(t, _nbytes(t) * n, group,
                 root=_global_peer(group, _arg(a, k, 2, "src"), k.get("group_src")))


def _send(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 2, "group")
    return _Call(t, _nbytes(t), group,
                 peer=_global_peer(group, _arg(a, k, 1, "dst"), k.get("group_dst")))


def _recv(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 2, "group")
    return _Call(t, _nbytes(t), group,
                 peer=_global_peer(group, _arg(a, k, 1, "src"), k.get("group_src")))


def _barrier(*a, **k):
    return _Call(torch.empty(0), 0, _arg(a, k, 0, "group"))


C10D_WRAPPERS = [
    ("all_reduce", "all_reduce", _all_reduce),
    ("all_gather_into_tensor", "all_gather", _all_gather_into),
    ("all_gather_single", "all_gather", _all_gather_into),
    ("all_gather", "all_gather", _all_gather_list),
    ("all_gather_coalesced", "all_gather", _all_gather_coalesced),
    ("reduce_scatter_single", "reduce_scatter", _reduce_scatter_input),
    ("reduce_scatter_tensor", "reduce_scatter", _reduce_scatter_input),
    ("reduce_scatter", "reduce_scatter", _reduce_scatter_list),
    ("reduce", "reduce", _reduce),
    ("all_reduce_coalesced", "all_reduce", _all_reduce_coalesced),
    ("all_to_all_single", "all_to_all", _all_to_all_single),
    ("all_to_all", "all_to_all", _all_to_all_list),
    ("broadcast", "broadcast", _broadcast),
    ("gather", "gather", _gather),
    ("scatter", "scatter", _scatter),
    ("send", "send", _send),
    ("isend", "send", _send),
    ("recv", "recv", _recv),
    ("irecv", "recv", _recv),
    ("barrier", "barrier", _barrier),
]


# functional collectives: (tensor, ..., group, tag); ``group`` is a process group, a list of
# ranks, a (DeviceMesh, dim) pair or a group name


def _functional_group(group):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(funcol._resolve_group_name(group))


def _functional(tensor_pos: int, group_pos: int, scale=None):
    def size_of(*a, **k):
        t = a[tensor_pos] if len(a) > tensor_pos else next(iter(k.values()))
        group = _functional_group(_arg(a, k, group_pos, "group"))
        ts = list(t) if isinstance(t, (list, tuple)) else [t]
        nbytes = _sum_bytes(ts)
        if scale == "group":  # all-gather: the message is the gathered output
            nbytes *= _group_size(group)
        return _Call(ts[0], nbytes, group)
    return size_of


FUNCTIONAL_WRAPPERS = [
    ("all_reduce", "all_reduce", _functional(0, 2)),
    ("all_reduce_coalesced", "all_reduce", _functional(0, 2)),
    ("all_gather_tensor", "all_gather", _functional(0, 2, "group")),
    ("all_gather_single", "all_gather", _functional(0, 2, "group")),
    ("all_gather_tensor_autograd", "all_gather", _functional(0, 2, "group")),
    ("all_gather_single_autograd", "all_gather", _functional(0, 2, "group")),
    ("all_gather_into_tensor_coalesced", "all_gather", _functional(0, 1, "group")),
    ("all_gather_single_coalesced", "all_gather", _functional(0, 1, "group")),
    ("reduce_scatter_single_autograd", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_single_coalesced", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_tensor", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_single", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_tensor_autograd", "reduce_scatter", _functional(0, 3)),
    ("all_to_all_single", "all_to_all", _functional(0, 3)),
    ("all_to_all_single_autograd", "all_to_all", _functional(0, 3)),
]


def _shard_dim_alltoall_size(*a, **k):
    """DTensor's Shard -> Shard all-to-all: on CPU it falls back to an all-gather, recorded
    inside; elsewhere it is one all-to-all of the local shard."""
    t = _arg(a, k, 0, "input")
    mesh, dim = _arg(a, k, 3, "mesh"), _arg(a, k, 4, "mesh_dim")
    if mesh.device_type == "cpu":
        return None
    return _Call(t, _nbytes(t), mesh.get_group(dim))


def install() -> None:
    """Wrap torch.distributed's functions (idempotent). Call before DeepSpeed initialises:
    it caches some function references at start-up."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        import torch.distributed.distributed_c10d as c10d
        for name, op, size_of in C10D_WRAPPERS:
            _wrap(dist, name, op, size_of, sync_module=c10d)
        import torch.distributed._functional_collectives as funcol
        for name, op, size_of in FUNCTIONAL_WRAPPERS:
            _wrap(funcol, name, op, size_of, api="functional")
        try:
            import torch.distributed.tensor._collective_utils as dtensor_utils
            import torch.distributed.tensor.placement_types as placements
            _wrap(dtensor_utils, "shard_dim_alltoall", "all_to_all", _shard_dim_alltoall_size,
                  api="functional", sync_module=placements)
        except ImportError:  # DTensor not in this build
            pass
        _INSTALLED = True
