"""A driver ended by a termination signal cleans up as an exception would.

SIGTERM (what ``kill``, ``timeout``, CI time limits and job schedulers send) and SIGHUP (a
closed terminal) end a Python process at once by default: no ``finally`` block runs, so the
pools of local ranks are never closed and the ranks stay blocked in their collectives.
``on_termination()`` turns those signals into ``Terminated``, raised in the main thread where
the driver waits: the pools' ``finally`` blocks end the ranks, rows already appended stay on
disk, and the entry point exits with 128 + the signal's number (143 for SIGTERM, the shell's
convention). ``Terminated`` is a ``BaseException``, like ``KeyboardInterrupt``, so a loop that
reports one case's ``Exception`` and goes on does not swallow it.

A driver killed without a chance to run anything (SIGKILL, the OOM killer) is the ranks'
business: each rank watches its driver (``parbench.launch``'s lifeline) and exits when it is
gone.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

#: the signals turned into ``Terminated`` (those this platform has)
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                if hasattr(signal, name))


class Terminated(BaseException):
    """The process received ``signum``; ``exit_status`` is 128 + ``signum``."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def on_termination():
    """Within: SIGTERM and SIGHUP raise ``Terminated`` in the main thread, once (a second
    signal during the clean-up lets it finish). A signal this process ignores (SIGHUP under
    ``nohup``) stays ignored; outside the main thread (where Python cannot install a
    handler) nothing changes. The previous handlers are restored on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise Terminated(signum)

    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    installed = [sig for sig, old in previous.items() if old is not signal.SIG_IGN]
    try:
        for sig in installed:
            signal.signal(sig, handler)
        yield
    finally:
        for sig in installed:  # None: a handler set outside Python; the default is closest
            old = previous[sig]
            signal.signal(sig, signal.SIG_DFL if old is None else old)


def run_terminable(main, *args, prog: str, kept: str = "finished results are kept") -> int:
    """``main(*args)`` under ``on_termination``, for an entry point (the command line, the
    benchmark scripts): a termination signal ends it with ``PROG: terminated by SIGTERM;
    KEPT`` on stderr and returns 128 + the signal's number."""
    try:
        with on_termination():
            return main(*args)
    except Terminated as t:
        sys.stderr.write(f"{prog}: {t}; {kept}\n")
        return t.exit_status
