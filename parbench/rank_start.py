"""How local rank processes are started: a fork server that imported torch once.

``spawn`` starts every rank as a fresh interpreter that imports torch, torch.distributed and
parbench again: about 1.5 CPU-seconds per rank on a laptop core, paid for every pool (a
4-rank ``parbench run`` pays it four times, a test session hundreds of times). A fork server
(``multiprocessing``'s ``forkserver``) imports them once, in a process that never runs a
kernel, never starts a thread pool and never touches CUDA; each rank is then forked from it,
so it starts with the imports done and still has a clean CUDA context and its own OpenMP
state (libgomp's thread pool is created on first use, after the fork).

What spawn gave for free is restored explicitly: a rank takes the parent's environment as it
was when the pool started (``environment`` -- the server's own copy dates from its start),
and the server sets the one-thread defaults before torch is imported (``worker._setup_env``).
``PARBENCH_START=spawn`` (or a platform without fork) keeps spawn. Plain ``fork`` is not
offered (any other value gives spawn): a rank forked from the driver itself would inherit the
driver's end of every pool's lifeline and never see its driver go (``launch._watch_driver``),
besides copying the driver's threads' locks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys

#: what the fork server imports once: the parent's main script, as spawn runs it in each rank
#: (a task defined there unpickles), and what every rank imports anyway
PRELOAD = ["__main__", "parbench.rank_preload"]
#: the start methods ``PARBENCH_START`` may choose
STARTS = ("forkserver", "spawn")


def context():
    """The multiprocessing context ranks are started in."""
    method = os.environ.get("PARBENCH_START", "forkserver")
    if method not in STARTS or method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def environment() -> dict:
    """The parent's environment variables and import path now, for a rank to take."""
    return {"env": dict(os.environ), "path": list(sys.path)}


def adopt(parent: dict | None) -> None:
    """Make this rank's environment and import path the parent's (``environment``), as
    spawn would have."""
    if parent is None:
        return
    env = parent["env"]
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    sys.path[:] = parent["path"] + [p for p in sys.path if p not in parent["path"]]
