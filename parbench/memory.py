"""Peak memory per rank: live tensor storages on CPU, allocator statistics on CUDA.

On CPU a ``TorchDispatchMode`` sees every tensor an op creates; each new storage is counted
until Python frees it (a weak reference's callback). The peak is the model states alive at
the start plus the highest sum of storages created during the tracked region. Model-state
bytes (parameters, gradients, optimizer state) are counted exactly from the tensors a scheme
reports, each storage once.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def model_state_bytes(states: dict[str, list]) -> dict[str, int]:
    """{'params': [...], 'grads': [...], 'optimizer': [...]} -> bytes per category."""
    return {k: storage_bytes(v) for k, v in states.items()}


class _LiveStorages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._refs: list = []

    def _free(self, key, _ref=None):
        nb = self._live.pop(key, 0)
        self.current -= nb

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        for t in flat:
            # plain tensors only: a subclass (DTensor) has no storage of its own here, and the
            # ops on its local shards run below this mode and are not seen (documented limit)
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = id(st) if st.data_ptr() == 0 else st.data_ptr()
                if key in self._live or st.nbytes() == 0:
                    continue
                nb = st.nbytes()
                try:
                    self._refs.append(weakref.ref(st, lambda r, k=key: self._free(k)))
                except TypeError:
                    continue
                self._live[key] = nb
                self.current += nb
                self.peak = max(self.peak, self.current)
        return out


class PeakMemory:
    """``with PeakMemory(device, baseline_bytes) as pm: ...`` then ``pm.peak``."""

    def __init__(self, device: str = "cpu", baseline_bytes: int = 0):
        self.device = device
        self.baseline = baseline_bytes
        self.peak = 0
        self._mode = None

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self._mode = _LiveStorages()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._mode.__exit__(*exc)
            self.peak = self.baseline + self._mode.peak
        return False
