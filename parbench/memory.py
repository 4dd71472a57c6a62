"""Peak memory per rank: live tensor storages on CPU, allocator statistics on CUDA.

On CPU a ``TorchDispatchMode`` sees every tensor an op creates; each new storage is counted
until Python frees it (a weak reference's callback). The peak is the model states alive at
the start plus the highest sum of storages created during the tracked region. Model-state
bytes (parameters, gradients, optimizer state, other) are counted exactly, each storage once,
from every storage reachable from the scheme object (``live_model_states``): attributes,
containers, modules, optimizers, partials, bound methods, closures and class attributes.
Module globals are not followed (they are shared by every case a process runs, and hold the
golden runs' caches): a scheme keeps its state on itself, and what it keeps only for the
verdict in a ``KeptForChecks``.
"""
from __future__ import annotations

import collections
import functools
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .device import CudaPeak, kind


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
    """``with PeakMemory(device, baseline_bytes) as pm: ...`` then ``pm.peak``: the baseline
    (the model states alive at the start) plus the most the region added -- on CPU the live
    storages it created, on CUDA the allocator's peak over what was allocated at the start
    (``parbench.device.CudaPeak``). ``cuda``: the CUDA module (a fake in tests)."""

    def __init__(self, device: str = "cpu", baseline_bytes: int = 0, cuda=None):
        self.device = kind(device)
        self.baseline = baseline_bytes
        self.peak = 0
        self._mode = None
        self._cuda = CudaPeak(baseline_bytes, cuda) if self.device == "cuda" else None

    def __enter__(self):
        if self._cuda is not None:
            self._cuda.enter()
        else:
            self._mode = _LiveStorages()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._cuda is not None:
            self.peak = self._cuda.exit()
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

#: the categories the tracker attributes live storages to, in the order a storage is claimed:
#: ``checks`` holds what a scheme keeps only for the verdict to read (``KeptForChecks``) and
#: nothing else reaches; it is reported, and no closed form predicts it (``MODEL_STATES`` are
#: the compared categories)
CATEGORIES = ("params", "grads", "optimizer", "other", "checks")
MODEL_STATES = ("params", "grads", "optimizer", "other")
_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType,
          types.CodeType, types.FrameType, weakref.ref,
          weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet,
          torch.dtype, torch.device)


class KeptForChecks(dict):
    """Tensors a scheme keeps only so that the verdict can read them after its step (e.g. the
    gradients DeepSpeed's engine frees in ``step()``, read back by ``full_grads``). The
    tracker attributes their storages to ``checks`` -- measured and shown in the row, not
    compared with a closed form -- unless a parameter, gradient or optimizer state claims them
    first (issue 20, sec. 7: state the tracker is told about explicitly, not hidden in a module
    global)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage is what the rank holds); the tensor otherwise."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _callable_parts(obj) -> list | None:
    """What a callable holds on to, or None for anything else: a ``functools.partial``'s
    function and arguments, a bound method's object and function, a function's closure cells,
    defaults and attributes (not its module globals: those are shared by every case; issue 20,
    sec. 7: a full copy held in a partial, a closure or a bound method is the rank's)."""
    if isinstance(obj, (functools.partial, functools.partialmethod)):
        return [obj.func, obj.args, obj.keywords, getattr(obj, "__dict__", None)]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        return [*cells, obj.__defaults__, obj.__kwdefaults__, obj.__dict__]
    if isinstance(obj, types.BuiltinMethodType) or type(obj).__name__ == "method-wrapper":
        owner = getattr(obj, "__self__", None)  # a tensor's bound builtin (t.add_): the tensor
        return [] if isinstance(owner, types.ModuleType) else [owner]
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name bound later in the enclosing function)
        return False
    return True


def _class_state(cls: type) -> list:
    """The class attributes of ``cls`` and its bases that may hold tensors (containers,
    tensors, callables), parbench's contract and ``object`` left out: state a scheme keeps on
    its class is the rank's as much as state on the instance."""
    out = []
    for klass in cls.__mro__:
        if klass.__module__ in ("builtins", "parbench.scheme", "abc"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") or isinstance(value, (type, property, staticmethod,
                                                           classmethod, types.FunctionType)):
                continue
            out.append(value)
    return out


def _children(obj) -> list:
    """The objects the walk goes on to from ``obj`` (a tensor and an optimizer aside)."""
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return list(obj)
    parts = _callable_parts(obj)
    if parts is not None:
        return parts
    out = []
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        out.append(attrs)
    for klass in type(obj).__mro__:
        for slot in vars(klass).get("__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                out.append(getattr(obj, slot))
    return out


def reachable_tensors(root) -> tuple[list[torch.Tensor], list[torch.optim.Optimizer],
                                     list[torch.Tensor]]:
    """Every tensor and optimizer reachable from ``root`` through containers, modules,
    optimizers (and their hooks), instance attributes, partials, bound methods, closures and
    the class attributes of ``root``'s classes (not through module globals or C++ objects);
    and the tensors reached through a ``KeptForChecks``."""
    seen: set[tuple[int, bool]] = set()
    tensors, optimizers, kept = [], [], []
    stack = [(root, False), *((v, False) for v in _class_state(type(root)))]
    while stack:
        obj, in_kept = stack.pop()
        if (id(obj), in_kept) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add((id(obj), in_kept))
        if isinstance(obj, torch.Tensor):
            (kept if in_kept else tensors).append(obj)
            more = list(getattr(obj, "__dict__", {}).values())
            if obj.is_leaf and obj.grad is not None:
                more.append(obj.grad)
            inner = getattr(obj, "_local_tensor", None)
            if inner is not None:
                more.append(inner)
        elif isinstance(obj, torch.optim.Optimizer):
            if not in_kept:
                optimizers.append(obj)
            more = list(vars(obj).values())  # state, param_groups, and its hooks
        else:
            more = _children(obj)
        in_kept = in_kept or isinstance(obj, KeptForChecks)
        stack.extend((o, in_kept) for o in more)
    return tensors, optimizers, kept


def _storage_key(t: torch.Tensor):
    st = _local(t).untyped_storage()
    return (st.device.type, st.data_ptr() or id(st)), st.nbytes()


class _Claims:
    """Storages claimed by category: each counted once, in the first category of
    ``CATEGORIES`` that claims it (``fixed``: claims that a later one does not move)."""

    def __init__(self):
        self.category: dict = {}
        self.size: dict = {}
        self.fixed: set = set()

    def claim(self, t, category: str, fixed: bool = False) -> None:
        if t is None or t.device.type == "meta":
            return
        key, nbytes = _storage_key(t)
        if nbytes == 0 or key in self.fixed:
            return
        self.size[key] = nbytes
        prev = self.category.get(key)
        if fixed or prev is None or CATEGORIES.index(category) < CATEGORIES.index(prev):
            self.category[key] = category
        if fixed:
            self.fixed.add(key)

    def totals(self) -> dict[str, int]:
        """Bytes per category (``checks`` only when some storage is kept for the checks)."""
        out = {c: 0 for c in CATEGORIES}
        for key, category in self.category.items():
            out[category] += self.size[key]
        if not out["checks"]:
            del out["checks"]
        return out


def live_model_states(root, compute_dtype: torch.dtype = torch.float32,
                      declared: dict | None = None) -> dict[str, int]:
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
    - other: every other reachable storage -- a leaked full copy shows here, be it held in
      an attribute, a container, a partial, a closure, a bound method or a class attribute;
    - checks: storages reached only through a ``KeptForChecks`` (absent when none).

    A storage is counted once, in the first category of that order that claims it.
    ``declared`` (``Scheme.state_tensors``: category -> tensors) attributes the storages it
    lists first; every other reachable storage is still counted (a list cannot hide one).
    """
    tensors, optimizers, kept = reachable_tensors(root)
    claims = _Claims()
    _claim_declared(claims, declared or {})
    mixed = compute_dtype != torch.float32
    stepped = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    weights: set = set()  # storages of parameters (and of optimizer-stepped tensors)
    for t in tensors + kept:
        if id(t) in stepped:
            is_master = mixed and t.dtype == torch.float32
            claims.claim(t, "optimizer" if is_master else "params")
            weights.add(_storage_key(t)[0])
        elif isinstance(t, torch.nn.Parameter):
            claims.claim(t, "params")
            weights.add(_storage_key(t)[0])
    for t in tensors:
        # a gradient is the .grad of a weight: of a tensor that is, or views, a parameter's
        # storage (a receive buffer's .grad is an activation gradient: "other")
        if t.is_leaf and t.grad is not None and _storage_key(t)[0] in weights:
            claims.claim(_local(t.grad), "grads")
    for o in optimizers:
        for state in o.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    claims.claim(v, "optimizer")
    for t in tensors:
        claims.claim(t, "other")
    for t in kept:
        claims.claim(t, "checks")
    return claims.totals()


def _claim_declared(claims: _Claims, declared: dict) -> None:
    bad = sorted(set(declared) - set(CATEGORIES))
    if bad:
        raise ValueError(f"state_tensors() categories {bad} are not among {CATEGORIES}")
    for category in CATEGORIES:
        for t in declared.get(category, ()):
            if _storage_key(t)[0] not in claims.fixed:
                claims.claim(t, category, fixed=True)


def declared_model_states(declared: dict) -> dict[str, int]:
    """Bytes of the tensors a scheme lists itself (``Scheme.state_tensors``: category ->
    tensors), each storage counted once, in the first category of ``CATEGORIES`` that lists
    it; unknown categories are an error."""
    claims = _Claims()
    _claim_declared(claims, declared)
    return claims.totals()


def model_states(scheme, compute_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """The scheme's model states: every storage reachable from it, attributed by the tracker
    (:func:`live_model_states`), those the scheme lists itself (``state_tensors``) in the
    category it lists them in."""
    return live_model_states(scheme, compute_dtype, scheme.state_tensors())


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
