"""Peak memory per rank: live tensor storages on CPU, allocator statistics on CUDA.

On CPU a ``TorchDispatchMode`` sees every tensor an op creates; each new storage is counted
until Python frees it (a weak reference's callback). The peak is the model states alive at
the start plus the highest sum of storages created during the tracked region. Model-state
bytes (parameters, gradients, optimizer state) are counted exactly from the tensors a scheme
reports, each storage once.
"""
from __future__ import annotations

import types
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


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (Adam moments and step counters)."""
    out = []
    for st in opt.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


# ---- model states, measured from what the rank holds ----------------------------------------

#: the categories the tracker attributes live storages to
CATEGORIES = ("params", "grads", "optimizer", "other")
_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType,
          types.FunctionType, types.BuiltinFunctionType, types.MethodType,
          types.CodeType, types.FrameType, weakref.ref, torch.dtype, torch.device)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage is what the rank holds); the tensor otherwise."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def reachable_tensors(root) -> tuple[list[torch.Tensor], list[torch.optim.Optimizer]]:
    """Every tensor and optimizer reachable from ``root`` through containers, modules,
    optimizers and instance attributes (not through functions, modules or C++ objects)."""
    seen: set[int] = set()
    tensors, optimizers = [], []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(getattr(obj, "__dict__", {}).values())
            inner = getattr(obj, "_local_tensor", None)
            if inner is not None:
                stack.append(inner)
            continue
        if isinstance(obj, torch.optim.Optimizer):
            optimizers.append(obj)
            stack.extend([obj.state, obj.param_groups])
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                stack.append(attrs)
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    stack.append(getattr(obj, slot))
    return tensors, optimizers


def _storage_key(t: torch.Tensor):
    st = _local(t).untyped_storage()
    return (st.device.type, st.data_ptr() or id(st)), st.nbytes()


def live_model_states(root, compute_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes of the storages live on this rank and reachable from ``root`` (a scheme), by
    category, attributed here and not by the scheme:

    - params: storages behind ``nn.Parameter``s and the tensors an optimizer steps, unless
      they are fp32 masters of a lower-precision run (a leaf that merely requires grad, such
      as a pipeline's receive buffer, is not a parameter);
    - grads: storages behind the ``.grad`` of a weight (a tensor whose storage is a
      parameter's or an optimizer-stepped tensor's, such as a view of a flat parameter
      buffer);
    - optimizer: every tensor of an optimizer's state (moments, step counters) and, when the
      model computes in a lower precision than fp32, the fp32 tensors the optimizer steps
      (the master weights; the ZeRO paper's K = 12 counts them);
    - other: every other reachable storage -- a leaked full copy shows here.

    A storage is counted once, in the first category of that order that claims it.
    """
    tensors, optimizers = reachable_tensors(root)
    claims: dict = {}
    sizes: dict = {}

    def claim(t, category):
        if t is None or t.device.type == "meta":
            return
        key, nbytes = _storage_key(t)
        if nbytes == 0:
            return
        sizes[key] = nbytes
        prev = claims.get(key)
        if prev is None or CATEGORIES.index(category) < CATEGORIES.index(prev):
            claims[key] = category

    mixed = compute_dtype != torch.float32
    stepped = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    weights: set = set()  # storages of parameters (and of optimizer-stepped tensors)
    for t in tensors:
        if id(t) in stepped:
            is_master = mixed and t.dtype == torch.float32
            claim(t, "optimizer" if is_master else "params")
            weights.add(_storage_key(t)[0])
        elif isinstance(t, torch.nn.Parameter):
            claim(t, "params")
            weights.add(_storage_key(t)[0])
    for t in tensors:
        # a gradient is the .grad of a weight: of a tensor that is, or views, a parameter's
        # storage (a receive buffer's .grad is an activation gradient: "other")
        if t.is_leaf and t.grad is not None and _storage_key(t)[0] in weights:
            claim(_local(t.grad), "grads")
    for o in optimizers:
        for state in o.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    claim(v, "optimizer")
    for t in tensors:
        claim(t, "other")
    out = {c: 0 for c in CATEGORIES}
    for key, category in claims.items():
        out[category] += sizes[key]
    return out


def declared_model_states(declared: dict) -> dict[str, int]:
    """Bytes of the tensors a scheme lists itself (``Scheme.state_tensors``: category ->
    tensors), each storage counted once, in the first category of ``CATEGORIES`` that lists
    it; unknown categories are an error."""
    bad = sorted(set(declared) - set(CATEGORIES))
    if bad:
        raise ValueError(f"state_tensors() categories {bad} are not among {CATEGORIES}")
    out = {c: 0 for c in CATEGORIES}
    seen: set = set()
    for category in CATEGORIES:
        for t in declared.get(category, ()):
            key, nbytes = _storage_key(t)
            if key not in seen:
                seen.add(key)
                out[category] += nbytes
    return out


def model_states(scheme, compute_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """The scheme's model states: what it declares (``state_tensors``), else what the
    tracker finds reachable from it (:func:`live_model_states`)."""
    declared = scheme.state_tensors()
    if declared is not None:
        return declared_model_states(declared)
    return live_model_states(scheme, compute_dtype)


class SavedActivations:
    """Bytes autograd saves for backward while the block runs, each storage counted once,
    weights (``exclude``: their storages) not counted -- the activation memory of a layer as
    Korthikanti et al. 2022 count it (Sec. 4), measured with ``saved_tensors_hooks``::

        with SavedActivations(exclude=model.parameters()) as saved:
            loss = model(x, y)
        saved.bytes
    """

    def __init__(self, exclude=()):
        self._skip = {_storage_key(t)[0] for t in exclude}
        self._seen: dict = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        if t.device.type != "meta":
            key, nbytes = _storage_key(t)
            if key not in self._skip:
                self._seen[key] = nbytes
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())
