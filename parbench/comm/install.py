"""Wrapping ``torch.distributed`` and the functional collectives once per process."""
from __future__ import annotations

import functools
import threading
import time
from fractions import Fraction

import torch.distributed as dist

from ..analytic.comm import ROOTED
from . import recording
from .calls import (C10D_WRAPPERS, FUNCTIONAL_WRAPPERS, _Call, _group_info, _group_size,
                    _shard_dim_alltoall_size)
from .recording import CommRecord, wire_pair

_INSTALLED = False
_TLS = threading.local()  # per thread: inside a wrapped call (nested calls are not recorded)


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    """'float32' for torch.float32 (cached: ``str`` of a dtype, every call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _thread_name() -> str:
    """The calling thread's name, kept per thread."""
    name = getattr(_TLS, "name", None)
    if name is None:
        name = _TLS.name = threading.current_thread().name
    return name


def _record(op: str, call: _Call, work, t0: float, is_async: bool, api: str) -> None:
    """Note one call in the active ledger. On a step whose timeline wants the calls (the
    exported one) the record is built at once, with its completion callback; on every other
    step only the call's facts are kept -- its group, sizes, times, the tensor's dtype but
    not the tensor -- and the ledger builds the records when it is read, after the step
    (``Ledger.records``): the group's size and rank, the axis name, the exact wire bytes and
    the record are arithmetic the step need not wait for."""
    led = recording.active()
    if led is None:
        return
    t = call.tensor
    raw = (op, call.group, call.message_bytes, call.kept_bytes, call.peer, call.root,
           t.dtype, t.element_size(), t0, time.perf_counter(), is_async, _thread_name(), api)
    tl = led.timeline
    if tl is None:
        led.add_raw(raw)
        return
    rec, wire = build(raw, led.axis)
    led.add(rec, wire)
    # the completion time is wanted by a timeline only (a callback per call costs a
    # future and a wake-up of the backend's thread)
    if work is not None and is_async and hasattr(work, "get_future"):
        try:
            fut = work.get_future()

            def _done(_f, rec=rec):
                rec.end = time.perf_counter()
                tl.add_comm(rec)

            fut.then(_done)
            return
        except Exception:  # backends without futures: issue time only
            pass
    tl.add_comm(rec)


def build(raw: tuple, axis_of) -> tuple[CommRecord, Fraction]:
    """The record of one call's facts (``_record``'s tuple) and its exact wire bytes."""
    (op, group, message_bytes, kept_bytes, peer, root, dtype, esize, t0, t1, is_async,
     thread, api) = raw
    size, group_rank = _group_info(group)
    n = 2 if op in ("send", "recv") else size
    if root is not None and op in ROOTED:
        root = dist.get_group_rank(group, root) if group is not None else root
    else:
        root = None
    if kept_bytes is not None and n > 1:
        wire = Fraction(message_bytes - kept_bytes)
        wire_f = float(wire)
    else:
        wire, wire_f = wire_pair(op, message_bytes, n, group_rank, root)
    rec = CommRecord(op=op, axis=axis_of(group), group_size=n, dtype=_dtype_name(dtype),
                     elements=message_bytes // max(esize, 1), message_bytes=message_bytes,
                     wire_bytes=wire_f, peer=-1 if peer is None else peer, start=t0, end=t1,
                     async_op=is_async, thread=thread, api=api)
    return rec, wire


def _wrap(module, name: str, op: str, size_of, api: str = "c10d", sync_module=None) -> None:
    orig = getattr(module, name, None)
    if orig is None or getattr(orig, "_parbench_wrapped", False):
        return

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        sink = recording.status_sink()
        if getattr(_TLS, "inside", False) or (recording.active() is None and sink is None):
            # inside another wrapped call (blocking send calls isend): the outer call is the
            # one record
            return orig(*args, **kwargs)
        try:
            call = size_of(*args, **kwargs)
        except Exception:  # an argument form we do not know: run the call, record nothing
            return orig(*args, **kwargs)
        if call is None:  # the wrapped function forwards to wrapped calls: let them record
            return orig(*args, **kwargs)
        if sink is not None:
            size = _group_size(call.group) if call.group is not None else "?"
            sink(f"{op} ({api}) of {call.message_bytes} bytes on a group of {size} ranks")
        t0 = time.perf_counter()
        _TLS.inside = True
        try:
            work = orig(*args, **kwargs)
        finally:
            _TLS.inside = False
            if sink is not None:
                sink("")
        is_async = bool(kwargs.get("async_op", False)) or name in ("isend", "irecv") \
            or api == "functional"
        _record(op, call, work, t0, is_async, api)
        return work

    wrapper._parbench_wrapped = True
    wrapper._parbench_orig = orig
    setattr(module, name, wrapper)
    if sync_module is not None and getattr(sync_module, name, None) is orig:
        setattr(sync_module, name, wrapper)



def install() -> None:
    """Wrap torch.distributed's functions (idempotent). Call before DeepSpeed initialises:
    it caches some function references at start-up."""
    global _INSTALLED
    with recording.LOCK:
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
