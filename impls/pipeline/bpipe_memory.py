"""BPipe's activation handles: the saved storages of one (micro-batch, stage), evictable.

``EvictableActivations`` is ``activations.HeldActivations`` with two more jobs:

* during a forward it files every storage autograd saves (weights, tokens and targets
  excepted) under the micro-batch's key -- the *handle* BPipe evicts and loads (Kim et al.
  2023, Sec. 3: the activations of one micro-batch on one stage move as a unit);
* it counts the bytes resident on the rank twice: ``bytes`` (what is really held: evicted
  storages leave it when freed and come back when loaded; activations a rank holds for its
  partner are added with ``hold``/``unhold``) and ``bytes_unevicted`` (the same storages as
  if nothing were evicted: 1F1B's figure for the same run).

Storages are identified by their ``StorageImpl`` (``_cdata``), which, unlike the data
pointer, survives ``resize_``: an evicted storage is resized to 0 bytes (the memory is
released, every tensor and view over it -- the graph's saved tensors, the stage's received
input -- stays valid) and resized back and refilled by the load, so the graph runs its
backward on the same tensors. The same calls work on CUDA (the caching allocator keeps a
storage freed while a send on another stream reads it until that stream is done).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.autograd.graph import saved_tensors_hooks

from .activations import HeldActivations, _Token


def byte_view(storage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class EvictableActivations(HeldActivations):
    """Held graphs and bytes, per-micro-batch storage handles, eviction-aware counts."""

    def __init__(self):
        super().__init__()
        self.bytes_unevicted = 0
        self.peak_unevicted = 0
        self._full: dict = {}       # storage id -> bytes when saved (kept through eviction)
        self.handles: dict = {}     # key -> [storage, ...] in the order first saved
        self.capture: tuple | None = None  # the key the next forward's storages go to
        # micro-batches whose activations are on this rank: its graphs not evicted, and the
        # partner's it holds
        self.resident = 0
        self.peak_resident = 0

    def reset_peaks(self) -> None:
        with self._lock:
            super().reset_peaks()
            self.peak_unevicted = self.bytes_unevicted
            self.peak_resident = self.resident

    def _count(self, delta: int) -> None:
        with self._lock:
            self.resident += delta
            self.peak_resident = max(self.peak_resident, self.resident)

    def _release(self) -> None:  # a graph was freed (after its backward)
        super()._release()
        self._count(-1)

    def _bump(self, delta: int, unevicted: int = 0) -> None:
        with self._lock:
            self.bytes += delta
            self.bytes_unevicted += unevicted
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self.peak_unevicted = max(self.peak_unevicted, self.bytes_unevicted)

    def _free(self, key) -> None:  # the storage died
        with self._lock:
            super()._free(key)
            self.bytes_unevicted -= self._full.pop(key, 0)

    def _counted(self, key, nbytes: int) -> None:  # a new storage (HeldActivations._add)
        self._full[key] = nbytes
        self._bump(nbytes, nbytes)

    @contextmanager
    def forward(self, existing: list):
        """As ``HeldActivations.forward``; the storages also go to ``handles[capture]``."""
        skip = {t.untyped_storage()._cdata for t in existing if t is not None}
        token = _Token()
        with self._lock:
            self.held += 1
            self.peak_held = max(self.peak_held, self.held)
        self._count(1)
        weakref.finalize(token, self._release)
        handle = None if self.capture is None else self.handles.setdefault(self.capture, [])
        filed: set = set()

        def pack(t):
            st = t.untyped_storage()
            key = st._cdata
            if key not in skip:
                self._add(key, st)
                if handle is not None and key not in filed and st.nbytes():
                    filed.add(key)
                    handle.append(st)
            return token, t.detach()

        with saved_tensors_hooks(pack, lambda packed: packed[1]):
            yield
        del token

    # ---- eviction ------------------------------------------------------------------------
    def pack_handle(self, key) -> torch.Tensor:
        """One flat uint8 copy of the handle's storages, in filing order (the evict message)."""
        return torch.cat([byte_view(st) for st in self.handles[key]])

    def drop(self, key) -> int:
        """Release the handle's storages (resized to 0 bytes); returns the bytes freed."""
        freed = 0
        for st in self.handles[key]:
            sid = st._cdata
            with self._lock:
                freed += self._live.get(sid, 0)
                self._live[sid] = 0
            st.resize_(0)
        self._bump(-freed)
        self._count(-1)
        return freed

    def restore(self, key, flat: torch.Tensor) -> None:
        """Resize the handle's storages back and fill them from ``flat``, in filing order;
        the handle is done with."""
        offset, total = 0, 0
        for st in self.handles.pop(key):
            sid = st._cdata
            n = self._full[sid]
            st.resize_(n)
            byte_view(st).copy_(flat[offset:offset + n])
            offset += n
            with self._lock:
                self._live[sid] = n
            total += n
        if offset != flat.numel():
            raise RuntimeError(f"bpipe: loaded {flat.numel()} bytes for {key}, its storages "
                               f"hold {offset}")
        self._bump(total)
        self._count(1)

    def hold(self, nbytes: int) -> None:
        """A partner's evicted activations arrive (their buffer is allocated)."""
        self._bump(nbytes, 0)
        self._count(1)

    def unhold(self, nbytes: int) -> None:
        self._bump(-nbytes, 0)
        self._count(-1)
