"""What a pipeline rank really keeps for its backwards: held graphs and saved activation bytes.

During each forward the executor installs ``torch.autograd.graph.saved_tensors_hooks``: the
pack hook sees every tensor autograd saves for the backward of that (micro-batch, stage).
So the figures are measured, not counted from the action list:

* held graphs: the pack hook stores each saved tensor together with a token of its
  (micro-batch, stage); the token lives exactly as long as some saved tensor of that graph
  does, and a weak-reference finalizer on it reports when autograd lets the graph go --
  after the fused backward, or after W for a split backward, which keeps the graph between
  B and W (Qi et al. 2024, Sec. 2). Storage shared between graphs (a stage's output handed
  to the next stage on the same rank) does not blur it;
* activation bytes: the storages behind the saved tensors, each counted once while alive
  (a finalizer on the storage), unless it existed before the forward (the weights the
  forward ran on, the step's tokens and targets): the activation memory of the rank,
  without the temporaries of a backward and without communication buffers.

Finalizers may run on autograd's worker threads (CUDA), hence the lock.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
from torch.autograd.graph import saved_tensors_hooks


def _key(t: torch.Tensor):
    st = t.untyped_storage()
    return st, (st.device.type, st.data_ptr() or id(st))


class _Token:
    """Stands for one graph: every tensor the graph saves is packed with it."""

    __slots__ = ("__weakref__",)


class HeldActivations:
    """Held graphs and live saved bytes of one rank, and their peaks."""

    def __init__(self):
        # re-entrant: a finalizer may run inside _add (a garbage collection it triggers)
        self._lock = threading.RLock()
        self._live: dict = {}     # storage key -> bytes
        self.bytes = 0
        self.held = 0
        self.peak_bytes = 0
        self.peak_held = 0

    def reset_peaks(self) -> None:
        """Start a new measurement from what is live now (carried micro-batches count)."""
        with self._lock:
            self.peak_bytes, self.peak_held = self.bytes, self.held

    def _release(self) -> None:
        with self._lock:
            self.held -= 1

    def _free(self, key) -> None:
        with self._lock:
            self.bytes -= self._live.pop(key, 0)

    def _add(self, key, storage) -> None:
        with self._lock:
            if key in self._live:
                return
            nbytes = storage.nbytes()
            if not nbytes:
                return
            weakref.finalize(storage, self._free, key)
            self._live[key] = nbytes
            self._counted(key, nbytes)

    def _counted(self, key, nbytes: int) -> None:
        """A new storage of ``nbytes`` is live (called under the lock); subclasses that
        keep more counts extend this."""
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    @contextmanager
    def forward(self, existing: list):
        """Measure the graph the forward inside the block builds; storages of the tensors in
        ``existing`` (weights, tokens, targets) are not activations."""
        skip = {_key(t)[1] for t in existing if t is not None}
        token = _Token()
        with self._lock:
            self.held += 1
            self.peak_held = max(self.peak_held, self.held)
        weakref.finalize(token, self._release)

        def pack(t):
            storage, key = _key(t)
            if key not in skip:
                self._add(key, storage)
            # detached: a saved output packed with its grad_fn would make a reference cycle
            # (node -> saved tensor -> node) that only a backward without retain_graph
            # breaks, so a split backward's graph would never be freed
            return token, t.detach()

        with saved_tensors_hooks(pack, lambda packed: packed[1]):
            yield
        del token
