"""Where a rank's CPU goes during a step: the calling thread (the scheme's own work: its Python,
its kernels, the autograd engine on CPU) apart from the process's other threads (the
collective backend's: gloo's TCP event loop ``gloo_tcp_loop`` and its algorithm workers
``pt_gloo_runloop``; NCCL's proxy and watchdog threads on CUDA).

Issue 24 asks, for every pair where ours is slower than a framework, for the reason in the
benchmark's output. On shared cores a step's wall time is its ranks' CPU, so the split says
whether ours does more work itself or the backend's threads spend more on the same
collectives. ``own_seconds`` is ``time.thread_time`` (every platform); ``by_thread`` reads
each thread's ``schedstat`` run time (nanoseconds) from ``/proc/self/task`` -- Linux only,
empty elsewhere -- and is taken outside the step's timer.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter

_TASKS = "/proc/self/task"


def own_seconds() -> float:
    """CPU seconds of the calling thread."""
    return time.thread_time()


def by_thread() -> Counter:
    """CPU seconds per thread name of this process's threads other than the calling one
    (threads of one name summed); empty where ``/proc`` has no task list."""
    me = str(threading.get_native_id())
    out: Counter = Counter()
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        out[name] += ns * 1e-9
    return out


def add_delta(total: Counter, before: Counter, after: Counter) -> None:
    """Add each thread name's CPU seconds between two ``by_thread`` readings to ``total``
    (a thread started in between counts from zero)."""
    for name, seconds in after.items():
        total[name] += max(seconds - before.get(name, 0.0), 0.0)
