"""``parbench.terminate``: SIGTERM / SIGHUP as an exception in the main thread, once; ignored
signals stay ignored; the previous handlers come back (the command line runs inside pytest's
process too). The processes it leaves no trace of: tests/cli/test_terminate.py."""
from __future__ import annotations

import contextlib
import signal
import threading

import pytest

from parbench.terminate import SIGNALS, Terminated, on_termination, run_terminable


@contextlib.contextmanager
def _handlers_kept():
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def test_a_signal_raises_once_and_the_previous_handler_comes_back():
    seen = []
    with _handlers_kept():
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
        with pytest.raises(Terminated) as info:
            with on_termination():
                try:
                    signal.raise_signal(signal.SIGTERM)
                finally:  # the clean-up: a second signal lets it finish
                    signal.raise_signal(signal.SIGTERM)
                    seen.append("cleaned up")
        assert info.value.exit_status == 143 and info.value.signum == signal.SIGTERM
        signal.raise_signal(signal.SIGTERM)  # the handler from before, again
    assert seen == ["cleaned up", signal.SIGTERM]


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_an_ignored_signal_stays_ignored():
    with _handlers_kept():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
        with on_termination():
            signal.raise_signal(signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def test_outside_the_main_thread_nothing_changes():
    before = signal.getsignal(signal.SIGTERM)
    inside = []

    def body():
        with on_termination():
            inside.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert inside == [before]


def test_an_entry_point_exits_with_128_plus_the_signal(capsys):
    def main(code):
        signal.raise_signal(signal.SIGTERM)
        return code

    with _handlers_kept():
        assert run_terminable(main, 0, prog="tool", kept="rows kept") == 128 + signal.SIGTERM
        assert run_terminable(lambda: 5, prog="tool") == 5
    assert capsys.readouterr().err == "tool: terminated by SIGTERM; rows kept\n"
