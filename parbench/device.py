"""Everything parbench does differently on a GPU, in one place.

The harness, the memory tracker, the calibration and the rank set-up ask this module, never
``torch.cuda`` directly:

- **backend and rank placement** (``backend_for``, ``bind_rank``): gloo on CPU, NCCL on
  CUDA with one device per rank, ``cuda:LOCAL_RANK``. ``PARBENCH_BACKEND=gloo`` runs the
  ranks of a CUDA case over gloo instead; only then may several ranks share one GPU (NCCL
  refuses two ranks on one device), and gloo moves CUDA tensors only for some collectives
  (all-reduce, broadcast, all-gather, all-to-all);
- **step timing** (``StepTimer``): on CUDA two events recorded on the current stream around
  the step, the end event synchronised, their elapsed time -- the device's time for the
  step, not the host's time to queue its kernels; on CPU ``time.perf_counter``;
- **peak memory** (``CudaPeak``): the allocator's ``max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus what was allocated when the region began, plus the
  model-state baseline -- the same quantity as the CPU tracker of live storages
  (``parbench.memory.PeakMemory``): the states at the start plus the most the region added;
- ``synchronize``, ``require`` (a clear error, before any rank is spawned, when CUDA is asked
  for and absent, or a world needs more GPUs than the machine has) and ``gpu_slug`` (the
  profile name of a GPU: ``h100-80gb``, ``h200-141gb``, ...).

Each function takes the CUDA module as an argument (default ``torch.cuda``), so the tests
drive the CUDA branches with a fake one on a CPU machine (``tests/unit/test_device.py``).
"""
from __future__ import annotations

import os
import re
import time

BACKENDS = ("gloo", "nccl")


class DeviceError(ValueError):
    """Bad device input (``parbench.config.ConfigError`` is raised by the callers that
    report it as bad input)."""


def _cuda(cuda=None):
    if cuda is not None:
        return cuda
    import torch
    return torch.cuda


def kind(device) -> str:
    """``cpu`` or ``cuda`` from ``cpu``, ``cuda``, ``cuda:1`` or a ``torch.device``."""
    name = str(device).split(":")[0]
    if name not in ("cpu", "cuda"):
        raise DeviceError(f"device={str(device)!r} must be cpu or cuda")
    return name


def backend_for(device, env=None) -> str:
    """The process-group backend: NCCL for CUDA, gloo for CPU; ``PARBENCH_BACKEND`` (gloo or
    nccl) overrides it for CUDA (NCCL has no CPU tensors, so it is refused on CPU)."""
    env = os.environ if env is None else env
    default = "nccl" if kind(device) == "cuda" else "gloo"
    chosen = env.get("PARBENCH_BACKEND", "") or default
    if chosen not in BACKENDS:
        raise DeviceError(f"PARBENCH_BACKEND={chosen!r} must be one of {', '.join(BACKENDS)}")
    if chosen == "nccl" and kind(device) == "cpu":
        raise DeviceError("PARBENCH_BACKEND='nccl' needs device=cuda (NCCL moves no CPU "
                          "tensors)")
    return chosen


def local_device(rank: int, backend: str, env=None, cuda=None) -> int:
    """The CUDA device of this rank: ``LOCAL_RANK`` (else the rank), modulo the devices when
    the backend lets ranks share one (gloo); with NCCL a rank beyond the devices is an
    error."""
    env = os.environ if env is None else env
    count = _cuda(cuda).device_count()
    local = int(env.get("LOCAL_RANK", rank))
    if count < 1:
        raise DeviceError("device=cuda: no CUDA device is visible to this process")
    if local < count:
        return local
    if backend == "nccl":
        raise DeviceError(f"LOCAL_RANK={local} but {count} CUDA device(s): NCCL needs one GPU "
                          "per rank (it refuses two ranks on one device); "
                          "PARBENCH_BACKEND=gloo lets ranks share a GPU")
    return local % count


def bind_rank(device, rank: int, env=None, cuda=None) -> tuple[str, str]:
    """(this rank's device string, its backend): ``("cpu", "gloo")`` on CPU; on CUDA the
    rank's device is made current (``torch.cuda.set_device``) and named ``cuda:N``."""
    backend = backend_for(device, env)
    if kind(device) == "cpu":
        return "cpu", backend
    local = local_device(rank, backend, env, cuda)
    _cuda(cuda).set_device(local)
    return f"cuda:{local}", backend


def require(device, world_size: int = 1, env=None, cuda=None) -> None:
    """Raise ``DeviceError`` (one line: the field, its value, the rule) when ``device`` cannot
    run here: CUDA asked for without a CUDA device, or a world of NCCL ranks larger than the
    GPUs of this machine (under torchrun each node's launcher places its own ranks)."""
    if kind(device) == "cpu":
        backend_for(device, env)
        return
    cu = _cuda(cuda)
    if not cu.is_available():
        import torch
        raise DeviceError(f"device={str(device)!r}: no CUDA device on this machine "
                          f"(torch {torch.__version__}: torch.cuda.is_available() is False)")
    env = os.environ if env is None else env
    count = cu.device_count()
    if backend_for(device, env) == "nccl" and world_size > count and "RANK" not in env:
        raise DeviceError(f"world_size={world_size} on device='cuda' needs {world_size} GPUs "
                          f"for NCCL (one per rank), this machine has {count}; "
                          "PARBENCH_BACKEND=gloo shares them")


def synchronize(device, cuda=None) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if kind(device) == "cuda":
        _cuda(cuda).synchronize()


class StepTimer:
    """Seconds of a region of work: ``t = StepTimer(device); t.start(); ...; t.stop()``.

    On CUDA two ``torch.cuda.Event(enable_timing=True)`` on the current stream, the end one
    synchronised: the device's own time from the first queued kernel's start to the last's
    end (host-side timing would see only the time to queue asynchronous kernels). On CPU
    ``time.perf_counter``."""

    def __init__(self, device, cuda=None, clock=time.perf_counter):
        self.cuda = kind(device) == "cuda"
        self._cu = _cuda(cuda) if self.cuda else None
        self._clock = clock
        self._t0 = None
        self._start = None

    def start(self) -> "StepTimer":
        if self.cuda:
            self._start = self._cu.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = self._clock()
        return self

    def stop(self) -> float:
        """Seconds since ``start`` (on CUDA, after waiting for the work queued meanwhile)."""
        if self.cuda:
            if self._start is None:
                raise RuntimeError("StepTimer.stop() before start()")
            end = self._cu.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self._start.elapsed_time(end) / 1e3  # events count milliseconds
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() before start()")
        return self._clock() - self._t0


class CudaPeak:
    """The CUDA half of ``parbench.memory.PeakMemory``: ``enter()`` synchronises, resets the
    allocator's peak and notes what is allocated; ``exit()`` synchronises and returns
    ``baseline + max_memory_allocated - allocated at entry``."""

    def __init__(self, baseline_bytes: int = 0, cuda=None):
        self.baseline = baseline_bytes
        self._cu = _cuda(cuda)
        self.at_entry = 0
        self.allocator_peak = 0  # the allocator's own peak over the region (all of it)

    def enter(self) -> None:
        self._cu.synchronize()
        self._cu.reset_peak_memory_stats()
        self.at_entry = self._cu.memory_allocated()

    def exit(self) -> int:
        self._cu.synchronize()
        self.allocator_peak = self._cu.max_memory_allocated()
        return self.baseline + max(self.allocator_peak - self.at_entry, 0)


#: (pattern in the device name, memory threshold in GiB or 0, profile name), first match wins
_SLUGS = (("H200", 0, "h200-141gb"), ("H100", 90, "h100-94gb"), ("H100", 0, "h100-80gb"),
          ("A100", 60, "a100-80gb"), ("A100", 0, "a100-40gb"), ("B200", 0, "b200-180gb"))


def gpu_slug(name: str, total_bytes: float) -> str:
    """A GPU's profile name: the datasheet preset's name for the GPUs parbench has presets
    of (``NVIDIA H200`` -> ``h200-141gb``), else its name in lower case with its memory in
    whole GiB (``nvidia-l4-22gb``)."""
    gib = total_bytes / 2 ** 30
    for pattern, at_least, slug in _SLUGS:
        if pattern in name.upper() and gib >= at_least:
            return slug
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
    return f"{base}-{round(gib)}gb"


def describe(device, cuda=None) -> dict:
    """What the device is: kind, name, memory bytes (CUDA), for the device check's summary."""
    if kind(device) == "cpu":
        import platform
        return {"kind": "cpu", "name": platform.processor() or platform.machine(),
                "cpus": os.cpu_count()}
    cu = _cuda(cuda)
    props = cu.get_device_properties(0)
    return {"kind": "cuda", "name": props.name, "memory_bytes": int(props.total_memory),
            "count": cu.device_count(), "slug": gpu_slug(props.name, props.total_memory)}


def flash_attention(device, dtype, heads: int, seq: int, head_dim: int,
                    masked: bool = False) -> tuple[bool, str]:
    """Whether ``scaled_dot_product_attention`` can run its flash kernel for the reference
    model's attention at this shape (``parbench.model.blocks.Attention`` calls it with
    ``is_causal=True`` and no mask on unpacked sequences, an explicit mask on packed ones):
    one call under ``sdpa_kernel(FLASH_ATTENTION)``. (True, "") or (False, torch's reason,
    first line)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril() if masked else None
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=mask is None)
    except RuntimeError as e:
        return False, (str(e).strip().splitlines() or ["refused"])[0]
    return True, ""
