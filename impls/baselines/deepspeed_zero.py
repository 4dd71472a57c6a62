"""DeepSpeed ZeRO stages 1, 2 and 3 on the same case (Rajbhandari et al. 2020; DeepSpeed's
``DeepSpeedZeroOptimizer`` and ``DeepSpeedZeroOptimizer_Stage3``).

The engine is built with ``deepspeed.initialize`` after torch.distributed is up (the pool
initialised it; ``DS_ACCELERATOR=cpu`` on CPU machines, where DeepSpeed falls back to gloo), with
a client ``torch.optim.AdamW(foreach=False)`` of the same hyper-parameters, so no fused Adam
is compiled. ``engine.backward`` scales each micro-batch loss by 1/m itself
(``gradient_accumulation_steps = m``). DeepSpeed's collectives go through
``torch.distributed`` and land in parbench's ledger.

What the ledger shows is DeepSpeed's own traffic, not the paper's accounting (a finding, not an
error): see ``predict`` (the paper's figure) beside the measured row. The full gradients are
read with ``deepspeed.utils.safe_get_full_grad`` before ``engine.step()`` with the ledger
paused (that read is collective). DeepSpeed keeps process-global state (its comm backend,
groups, the engine's hooks), so each case gets a fresh pool (``isolated``).
"""
from __future__ import annotations

import os

import torch

from parbench import comm
from parbench.config import CaseConfig, ConfigError
from parbench.memory import KeptForChecks
from parbench.model import build_model, clip_local_, make_optimizer
from parbench.scheme import register

from impls.data.base import DataParallelScheme
from impls.zero.prediction import paper_prediction


#: a build lock older than this has no live builder (DeepSpeed's CPU extension builds in
#: about 90 s on a loaded 2-core machine)
STALE_LOCK_S = 600


def _clear_stale_locks(cache: str) -> None:
    """Remove build locks left by a rank killed mid-compile (the harness ends a hung case);
    torch's extension builder would otherwise wait on them forever."""
    import glob
    import time
    for lock in glob.glob(os.path.join(cache, "*", "lock")):
        try:
            if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
                os.remove(lock)
        except OSError:
            pass


def _import_deepspeed():
    # one extension directory per Python environment: two venvs sharing one would rebuild
    # DeepSpeed's CPU extension over each other (its build key is the source, not torch's)
    import hashlib
    import sys
    env = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    cache = os.path.join(os.path.expanduser("~"), ".cache", "parbench", "torch_extensions",
                         env)
    os.makedirs(cache, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", cache)
    _clear_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"])
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    return deepspeed


def deepspeed_config(case: CaseConfig, stage: int) -> dict:
    p, r = case.layout, case.run
    bucket = max(1, int(case.options.data.bucket_mb * 2**20 / 4))
    return {
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.num_microbatches,
        "train_batch_size": p.micro_batch_size * p.num_microbatches * p.dp,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket,
                              "stage3_prefetch_bucket_size": bucket,
                              # free every gathered parameter after use, as the paper's
                              # ZeRO-3 (and ours) does: no persistent small parameters, no
                              # reuse window between forward and backward
                              "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0,
                              "stage3_max_live_parameters": bucket},
        "bf16": {"enabled": r.dtype == "bf16"},
        "gradient_clipping": r.clip_grad,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class _MeshMPU:
    """The model-parallel-unit interface DeepSpeed asks for, answered from parbench's mesh, so
    DeepSpeed's collectives run on the mesh's own dp group (and are booked to axis dp)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def get_data_parallel_group(self):
        return self.mesh.group("dp")

    def get_data_parallel_group_ranks(self):
        return list(self.mesh.ranks("dp"))

    def get_data_parallel_rank(self):
        return self.mesh.index("dp")

    def get_data_parallel_world_size(self):
        return self.mesh.size("dp")

    def get_model_parallel_group(self):
        return self.mesh.group("tp")

    def get_model_parallel_rank(self):
        return self.mesh.index("tp")

    def get_model_parallel_world_size(self):
        return self.mesh.size("tp")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self.mesh.ranks("tp")[0]


class _DeepSpeedZero(DataParallelScheme):
    family = "data"
    uses = ("dp",)
    options = ("bucket_mb",)
    isolated = True
    stage = 1
    supports_clip_grad = True
    #: the engine scales each micro-batch's loss by 1/m itself (no per-token normalisation)
    supports_loss_mask = False

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.layout.world_size != case.layout.dp:
            raise ConfigError(f"dp={case.layout.dp} must equal the world size for {cls.name}")
        if case.run.optimizer != "adamw":
            raise ConfigError(f"optimizer={case.run.optimizer!r}: {cls.name} runs adamw only")

    def __init__(self, ctx):
        super().__init__(ctx)
        ds = _import_deepspeed()
        self._ds = ds
        model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.names = [n for n, _ in model.named_parameters()]
        opt = make_optimizer(model.parameters(), ctx.run)
        with _quiet():
            self.engine, self.opt, _, _ = ds.initialize(
                model=model, optimizer=opt, config=deepspeed_config(ctx.case, self.stage),
                mpu=_MeshMPU(ctx.mesh), dist_init_required=False)
        self._grads = KeptForChecks()  # the tracker's ``checks``: kept for full_grads only
        if ctx.run.dtype == "bf16":
            self._load_fp32_masters(build_model(ctx.model, ctx.run.seed))

    def _load_fp32_masters(self, reference) -> None:
        """bf16: DeepSpeed builds its fp32 master partitions from the module after casting it
        to bf16, so they start at the bf16-rounded initialisation (2.4e-4 off the fp32 one on
        the tiny model). They are set to the fp32 reference weights
        (``safe_set_full_fp32_param``), as loading an fp32 checkpoint into the engine does, so
        that the masters start where the golden run's fp32 weights do."""
        ref = dict(reference.named_parameters())
        with comm.unrecorded():
            for n, p in zip(self.names, self.engine.module.parameters()):
                self._ds.utils.safe_set_full_fp32_param(p, ref[n].detach().clone())

    def train_step(self, inputs, targets, step):
        m = self.ctx.layout.num_microbatches
        mbs = self.local_microbatches(inputs, targets)
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            with tl.span("F", mb=i):
                loss = self.engine(xm, ym)
            with tl.span("B", mb=i):
                self.engine.backward(loss)
            total += float(loss.detach()) / m
            if i == m - 1 and step < self.ctx.run.steps:
                self._capture_grads()
            with tl.span("optim" if i == m - 1 else "step", mb=i):
                self.engine.step()
        return self.reduce_loss(total / self.dp_size, self.group)

    def _capture_grads(self) -> None:
        """The full gradients before ``engine.step()``; with ``clip_grad``, clipped here by
        their global norm (DeepSpeed clips inside its step and frees them after): the
        gradients its step should consume, so the gradient check holds DeepSpeed's unclipped
        gradients and the update check whether its step clipped them by that factor."""
        with comm.unrecorded():
            self._grads = KeptForChecks()
            for n, p in zip(self.names, self.engine.module.parameters()):
                g = self._ds.utils.safe_get_full_grad(p)
                self._grads[n] = g.detach().float().clone().view(_shape(p))
            if self.ctx.run.clip_grad:
                clip_local_(list(self._grads.values()), self.ctx.run.clip_grad)

    def full_grads(self):
        return self._grads

    def full_params(self):
        params = list(self.engine.module.parameters())
        if self.stage == 3 and self.ctx.run.dtype != "bf16":
            with self._ds.zero.GatheredParameters(params):
                return {n: p.detach().float().clone() for n, p in zip(self.names, params)}
        if self.ctx.run.dtype == "bf16":  # the fp32 master weights (every stage)
            return {n: self._ds.utils.safe_get_full_fp32_param(p).detach().clone().view(_shape(p))
                    for n, p in zip(self.names, params)}
        return {n: p.detach().float().clone() for n, p in zip(self.names, params)}

    @classmethod
    def predict(cls, case: CaseConfig):
        return paper_prediction(case, cls.stage)


def _shape(p) -> tuple:
    return tuple(getattr(p, "ds_shape", p.shape))


class _quiet:
    """Keep DeepSpeed's start-up logging at warnings."""

    def __enter__(self):
        import logging
        self._lg = logging.getLogger("DeepSpeed")
        self._lvl = self._lg.level
        self._lg.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc):
        self._lg.setLevel(self._lvl)
        return False


@register
class DeepSpeedZero1(_DeepSpeedZero):
    name = "baseline.deepspeed.zero1"
    baseline_of = "zero.1"
    stage = 1
    description = "DeepSpeed ZeRO stage 1"


@register
class DeepSpeedZero2(_DeepSpeedZero):
    name = "baseline.deepspeed.zero2"
    baseline_of = "zero.2"
    stage = 2
    description = "DeepSpeed ZeRO stage 2"


@register
class DeepSpeedZero3(_DeepSpeedZero):
    name = "baseline.deepspeed.zero3"
    baseline_of = "zero.3"
    stage = 3
    description = "DeepSpeed ZeRO stage 3"
