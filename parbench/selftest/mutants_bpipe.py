"""Realistic bugs in BPipe (``impls.pipeline.bpipe``), each killed by the verdict. They run on
``FAMILY_CASES["pipeline"]`` with pp=4 and 8 micro-batches, where stage 0 evicts two
micro-batches to stage 3 (at pp=2 nothing is evicted):

* the loading side unpacks the message in another order than the evicting side packed it
  (storages refilled largest first instead of in the order they were saved): every evicted
  micro-batch's backward runs on scrambled activations -- caught by the golden run;
* the stage input (the embedding output on stage 0; the received boundary elsewhere) is
  freed with the other saved storages but not refilled on load (left zeroed) -- caught by
  the golden run (LayerNorm's gradients read it);
* the eviction rule compares the micro-batches in flight after the forward (evicted ones
  included), not the resident ones, with the threshold: once stage 0 is past it every
  micro-batch is evicted (five instead of two) and the peak is still four -- numerically
  right, caught by the evict and load bytes against BPipe's closed form.
"""
from __future__ import annotations

from impls.pipeline.bpipe import BPipeExecutor, BPipeScheme
from impls.pipeline.bpipe_memory import EvictableActivations, byte_view
from parbench.schedules.actions import FORWARD
from parbench.schedules.bpipe import eviction_plan

from .catalogue import mutant

CASE = {"pp": "4", "num_microbatches": "8"}


def _executor(tracker):
    """BPipe's executor with ``tracker`` (an ``EvictableActivations`` subclass) instead."""
    class Broken(BPipeExecutor):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.activations = tracker()
    return Broken


class _LargestFirst(EvictableActivations):
    def restore(self, key, flat) -> None:
        order = sorted(self.handles[key], key=lambda st: -self._full[st._cdata])
        self.handles[key] = order  # the bug: not the order pack_handle wrote them in
        super().restore(key, flat)


@mutant("bpipe-unpack-order", base="pipeline.bpipe", overrides=CASE,
        bug="the load refills the evicted storages largest first, not in the order the "
            "eviction packed them")
class BPipeUnpackOrder(BPipeScheme):
    executor_class = _executor(_LargestFirst)


class _InputNotRestored(EvictableActivations):
    def restore(self, key, flat) -> None:
        first = self.handles[key][0]  # the stage input: the first storage saved
        super().restore(key, flat)
        byte_view(first).zero_()  # the bug: freed with the rest, never refilled


@mutant("bpipe-input-not-restored", base="pipeline.bpipe", overrides=CASE,
        bug="the stage's input storage is evicted with the activations but not refilled on "
            "load (left zeroed)")
class BPipeInputNotRestored(BPipeScheme):
    executor_class = _executor(_InputNotRestored)


def _in_flight_rule(row, limit):
    """Evict every micro-batch whose forward leaves more than ``limit`` in flight."""
    out, in_flight = [], 0
    for a in row:
        in_flight += 1 if a.kind == FORWARD else -1
        if a.kind == FORWARD and in_flight > limit:
            out.append(a.mb)
    return out


@mutant("bpipe-evict-by-in-flight", base="pipeline.bpipe", overrides=CASE,
        bug="the eviction rule counts the micro-batches in flight (evicted ones included) "
            "instead of the resident ones, so it evicts every micro-batch past the threshold")
class BPipeEvictByInFlight(BPipeScheme):
    def make_plan(self):
        return eviction_plan(self.schedule, choose=_in_flight_rule)
