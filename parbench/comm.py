"""Instrumented collectives and the traffic ledger.

``install()`` wraps the public ``torch.distributed`` collective and point-to-point functions
once per process. Every call made while a ``Ledger`` is active is recorded, whoever makes it:
our schemes, DeepSpeed (whose ``deepspeed.comm`` forwards to these functions), FSDP2 and
``torch.distributed.pipelining``. torch DDP's C++ reducer is routed through Python by
registering the standard all-reduce communication hook (see ``impls/baselines/torch_ddp``).

Per-rank wire bytes follow bandwidth-optimal algorithms on a group of n ranks with message
size S (the full, gathered or reduced, tensor): all-reduce 2(n-1)/n*S (ring: reduce-scatter
then all-gather, Patarasuk & Yuan 2009), all-gather / reduce-scatter / all-to-all (n-1)/n*S,
broadcast S, send S (receives carry no sent bytes).
"""
from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

_state = threading.local()
_installed = False
_lock = threading.Lock()


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


def wire_bytes(op: str, message_bytes: int, n: int) -> Fraction:
    """Bytes one rank sends for ``op`` on ``n`` ranks with an S-byte message (exact)."""
    s = Fraction(message_bytes)
    if n <= 1 and op not in ("send",):
        return Fraction(0)
    if op == "all_reduce":
        return 2 * (n - 1) * s / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * s / n
    if op in ("broadcast", "send", "reduce", "scatter", "gather"):
        return s if op in ("broadcast", "send") else (n - 1) * s / n
    if op in ("recv", "barrier"):
        return Fraction(0)
    raise ValueError(f"unknown op {op!r}")


class Ledger:
    """Records of one rank. Use as a context manager around the code to account."""

    def __init__(self, axis_of=None, timeline=None):
        self.records: list[CommRecord] = []
        self._axis_of = axis_of  # callable(group) -> axis name
        self.timeline = timeline
        self._prev = None

    def __enter__(self) -> "Ledger":
        install()
        self._prev = getattr(_state, "ledger", None)
        _state.ledger = self
        return self

    def __exit__(self, *exc) -> None:
        _state.ledger = self._prev

    def pause(self):
        return _Paused()

    def axis(self, group) -> str:
        if self._axis_of is not None:
            name = self._axis_of(group)
            if name:
                return name
        return "world" if group is None or group is dist.group.WORLD else "other"

    def add(self, rec: CommRecord) -> None:
        self.records.append(rec)

    # ---- summaries ---------------------------------------------------------------------
    def summary(self) -> dict[str, dict[str, dict]]:
        """{axis: {op: {count, message_bytes, wire_bytes}}} (sends and receives separate)."""
        out: dict = defaultdict(lambda: defaultdict(lambda: {"count": 0, "message_bytes": 0,
                                                             "wire_bytes": 0.0}))
        for r in self.records:
            e = out[r.axis][r.op]
            e["count"] += 1
            e["message_bytes"] += r.message_bytes
            e["wire_bytes"] += r.wire_bytes
        return {a: dict(v) for a, v in out.items()}

    def wire_by_axis(self) -> dict[str, float]:
        """Exact per-axis sums (fractions of a byte from the ring factor are summed exactly
        before rounding to float, so equal totals compare equal)."""
        out: dict[str, Fraction] = defaultdict(Fraction)
        for r in self.records:
            out[r.axis] += wire_bytes(r.op, r.message_bytes, r.group_size)
        return {a: float(v) for a, v in out.items()}

    def total_wire(self) -> float:
        return sum(r.wire_bytes for r in self.records)

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    def clear(self) -> None:
        self.records.clear()


class _Paused:
    def __enter__(self):
        self._prev = getattr(_state, "ledger", None)
        _state.ledger = None

    def __exit__(self, *exc):
        _state.ledger = self._prev


def active() -> Ledger | None:
    return getattr(_state, "ledger", None)


# ---- the wrappers ---------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _record(op: str, tensor: torch.Tensor, message_bytes: int, group, work, t0: float,
            peer: int = -1, async_op: bool = False) -> None:
    led = active()
    if led is None:
        return
    n = _group_size(group)
    if op in ("send", "recv"):
        n = 2
    rec = CommRecord(op=op, axis=led.axis(group), group_size=n, dtype=str(tensor.dtype).replace(
        "torch.", ""), elements=message_bytes // max(tensor.element_size(), 1),
        message_bytes=message_bytes, wire_bytes=float(wire_bytes(op, message_bytes, n)),
        peer=peer, start=t0, end=time.perf_counter(), async_op=async_op)
    led.add(rec)
    tl = led.timeline
    if work is not None and async_op:
        try:
            fut = work.get_future()

            def _done(_f, rec=rec):
                rec.end = time.perf_counter()
                if tl is not None:
                    tl.add_comm(rec)
                return None

            fut.then(_done)
            return
        except Exception:  # backends without futures: issue time only
            pass
    if tl is not None:
        tl.add_comm(rec)


def _wrap(name: str, op: str, size_of):
    orig = getattr(dist, name, None)
    if orig is None:  # not in this torch version
        return
    if getattr(orig, "_parbench_wrapped", False):
        return

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if active() is None or getattr(_state, "in_wrapped", False):
            # inside another wrapped call (torch's blocking send/recv call isend/irecv):
            # the outer call is the one record
            return orig(*args, **kwargs)
        t0 = time.perf_counter()
        _state.in_wrapped = True
        try:
            work = orig(*args, **kwargs)
        finally:
            _state.in_wrapped = False
        tensor, nbytes, group, peer = size_of(*args, **kwargs)
        is_async = bool(kwargs.get("async_op", False)) or (op in ("send", "recv") and
                                                           name.startswith("i"))
        _record(op, tensor, nbytes, group, work, t0, peer, is_async)
        return work

    wrapper._parbench_wrapped = True
    wrapper._parbench_orig = orig
    setattr(dist, name, wrapper)
    # keep distributed_c10d's module attribute in sync for code importing from there
    import torch.distributed.distributed_c10d as c10d
    if getattr(c10d, name, None) is orig:
        setattr(c10d, name, wrapper)


def _arg(args, kwargs, i, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _all_reduce(*a, **k):
    t = _arg(a, k, 0, "tensor")
    return t, _nbytes(t), _arg(a, k, 2, "group"), -1


def _all_gather_into(*a, **k):
    out = _arg(a, k, 0, "output_tensor")
    return out, _nbytes(out), _arg(a, k, 2, "group"), -1


def _all_gather_list(*a, **k):
    lst = _arg(a, k, 0, "tensor_list")
    return lst[0], sum(_nbytes(t) for t in lst), _arg(a, k, 2, "group"), -1


def _reduce_scatter_tensor(*a, **k):
    inp = _arg(a, k, 1, "input")
    return inp, _nbytes(inp), _arg(a, k, 3, "group"), -1


def _reduce_scatter_list(*a, **k):
    lst = _arg(a, k, 1, "input_list")
    return lst[0], sum(_nbytes(t) for t in lst), _arg(a, k, 3, "group"), -1


def _reduce_scatter_single(*a, **k):
    inp = _arg(a, k, 1, "input")
    return inp, _nbytes(inp), _arg(a, k, 3, "group"), -1


def _reduce(*a, **k):
    t = _arg(a, k, 0, "tensor")
    return t, _nbytes(t), _arg(a, k, 3, "group"), -1


def _all_reduce_coalesced(*a, **k):
    lst = _arg(a, k, 0, "tensors")
    return lst[0], sum(_nbytes(t) for t in lst), _arg(a, k, 2, "group"), -1


def _all_to_all_single(*a, **k):
    inp = _arg(a, k, 1, "input")
    return inp, _nbytes(inp), _arg(a, k, 4, "group"), -1


def _all_to_all_list(*a, **k):
    lst = _arg(a, k, 1, "input_tensor_list")
    return lst[0], sum(_nbytes(t) for t in lst), _arg(a, k, 2, "group"), -1


def _broadcast(*a, **k):
    t = _arg(a, k, 0, "tensor")
    return t, _nbytes(t), _arg(a, k, 2, "group"), -1


def _send(*a, **k):
    t = _arg(a, k, 0, "tensor")
    return t, _nbytes(t), _arg(a, k, 2, "group"), _arg(a, k, 1, "dst", -1)


def _recv(*a, **k):
    t = _arg(a, k, 0, "tensor")
    return t, _nbytes(t), _arg(a, k, 2, "group"), _arg(a, k, 1, "src", -1)


def _barrier(*a, **k):
    return torch.empty(0), 0, _arg(a, k, 0, "group"), -1


_WRAPPERS = [
    ("all_reduce", "all_reduce", _all_reduce),
    ("all_gather_into_tensor", "all_gather", _all_gather_into),
    ("all_gather_single", "all_gather", _all_gather_into),
    ("all_gather", "all_gather", _all_gather_list),
    ("reduce_scatter_single", "reduce_scatter", _reduce_scatter_single),
    ("reduce", "reduce", _reduce),
    ("all_reduce_coalesced", "all_reduce", _all_reduce_coalesced),
    ("reduce_scatter_tensor", "reduce_scatter", _reduce_scatter_tensor),
    ("reduce_scatter", "reduce_scatter", _reduce_scatter_list),
    ("all_to_all_single", "all_to_all", _all_to_all_single),
    ("all_to_all", "all_to_all", _all_to_all_list),
    ("broadcast", "broadcast", _broadcast),
    ("send", "send", _send),
    ("isend", "send", _send),
    ("recv", "recv", _recv),
    ("irecv", "recv", _recv),
    ("barrier", "barrier", _barrier),
]


def install() -> None:
    """Wrap torch.distributed's functions (idempotent). Call before DeepSpeed initialises:
    it caches some function references at start-up."""
    global _installed
    with _lock:
        if _installed:
            return
        for name, op, size_of in _WRAPPERS:
            _wrap(name, op, size_of)
        _installed = True
