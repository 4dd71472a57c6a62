"""torchtitan (Liang et al. 2024, "TorchTitan: One-stop PyTorch native solution for
production ready LLM pre-training", arXiv 2410.06511) as a framework under test: its own
Llama 3 model (``impls.baselines.torchtitan_model``) parallelized by its own
``parallelize_llama`` (``torchtitan.models.llama3.parallelize``), compared with ``hybrid``.

The parallelism is torchtitan's default for Llama 3 on a pp x dp x cp x tp mesh:
tensor parallelism with sequence parallelism (``enable_sequence_parallel``, its default) from
the model's own sharding declarations (``set_llama3_sharding_config``), then FSDP2
(``apply_fsdp_to_decoder``: one unit per block and the root) on the ``fsdp`` axis, in fp32
(``mixed_precision_param="float32"``). Meshes come from torchtitan's ``ParallelDims``
(``build_mesh`` over the world group; its rank order -- tp fastest, then dp -- is parbench's
Megatron order). The SPMD backend is ``partial_dtensor`` (DTensor on the model-parallel axes,
torchtitan's classic path).

The loss is torchtitan's: ``components.loss.cross_entropy_loss`` (a sum over the
micro-batch's tokens, vocabulary-parallel under tp) divided by the global batch's token
count, and FSDP2 sums gradients over dp (``set_gradient_divide_factor(1.0)``), as torchtitan's
trainer does; the sum over all micro-batches and dp ranks is then the gradient of the global
mean token loss. The optimizer is parbench's rule (elementwise AdamW) on the DTensors' local
shards, as ``baseline.torch.fsdp2`` runs it.

Context parallelism (cp > 1) runs torchtitan 0.3.0's own path: ``ParallelDims`` with cp
(its ``fsdp`` axis then folds dp x cp, so FSDP2 shards and sums gradients over both),
``parallelize_llama``'s ``apply_cp_to_forward`` (wraps each block's
``ScaledDotProductAttention`` so q, k, v enter SDPA as cp-sharded DTensors, and enables torch's
CP dispatcher: ring attention, ``_templated_ring_attention``), and the trainer's input step,
``prepare_context_parallel_input`` with its default "headtail" load balancer (tokens, labels
and positions sharded along the sequence; the model takes the positions for RoPE). The loss
is each rank's token sum over its shard divided by the global token count, summed over
torchtitan's loss mesh (batch x cp). Shims: this module calls the input step per micro-batch
itself (torchtitan's ``Trainer`` is not built), and on CPU registers the CPU flash-attention
ops in torch's CP handler table (``register_cpu_sdpa`` of ``baseline.torch.context_parallel``:
torch's ring attention with the CPU kernel; torch has entries for the CUDA kernels only).

Pipeline parallelism (pp > 1, schedule gpipe, 1f1b or interleaved) runs torchtitan's
``pipeline_llm`` (``impls.baselines.torchtitan_pp``): its stage split, per-stage
``parallelize_llama`` and its torch.distributed.pipelining schedule; under cp the whole
local batch is sharded first and the positions go to every stage as a model kwarg.

On CPU two things differ from torchtitan's GPU defaults: attention is its
``ScaledDotProductAttention`` (FlexAttention has no CPU backward) and torchtitan 0.3.0 needs
``triton`` importable (its MoE kernels are imported on the Llama 3 path).
"""
from __future__ import annotations

import importlib

import torch

from parbench import comm
from parbench.batching import dp_slice, microbatches
from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.model import build_model, make_optimizer
from parbench.scheme import Scheme, register

from impls.baselines.torch_context_parallel import register_cpu_sdpa
from impls.baselines.torchtitan_pp import build_pipeline, check_titan_pp, pipeline_step
from impls.baselines.torchtitan_model import from_titan, titan_config, to_titan

#: the torchtitan release this adapter follows
TORCHTITAN_VERSION = "0.3.0"


def torchtitan_missing() -> str | None:
    """Why torchtitan's Llama 3 cannot be imported here, else None."""
    try:
        importlib.import_module("torchtitan.models.llama3.parallelize")
    except ImportError as e:
        return (f"torchtitan=={TORCHTITAN_VERSION} is not importable ({e}); install the "
                "'torchtitan' extra (it also needs triton)")
    return None


def check_titan_case(case: CaseConfig, model: str = "Llama 3") -> None:
    """Refuse what torchtitan's ``model`` block cannot express (Llama 3 and DeepSeek-V3 have
    RoPE, RMSNorm, SwiGLU, no biases, no learned positions, an untied head) or its TP plan
    cannot shard evenly."""
    m, tp = case.model, case.layout.tp
    fixed = [("rope_theta", m.rope_theta, m.rope_theta > 0, "> 0 (torchtitan's RoPE)"),
             ("mlp", m.mlp, m.mlp == "swiglu", "swiglu"),
             ("norm", m.norm, m.norm == "rmsnorm", "rmsnorm"),
             ("bias", m.bias, not m.bias, "false"),
             ("position_embeddings", m.position_embeddings, not m.position_embeddings,
              "false (RoPE only)"),
             ("tie_embeddings", m.tie_embeddings, not m.tie_embeddings, "false"),
             ("dtype", case.run.dtype, case.run.dtype == "fp32", "fp32")]
    for field, value, ok, rule in fixed:
        if not ok:
            raise ConfigError(f"{field}={value}: baseline.torchtitan's {model} needs {rule}")
    kv = m.num_kv_heads or m.num_heads
    for field, value in (("num_heads", m.num_heads), ("num_kv_heads", kv),
                         ("seq_length", m.seq_length)):
        if value % tp:
            raise ConfigError(f"{field}={value}: tp={tp} must divide it (torchtitan shards "
                              "heads, and the sequence under SP, evenly)")
    check_titan_cp(case)
    check_titan_pp(case)


def check_titan_cp(case: CaseConfig) -> None:
    """Under cp, torchtitan's head-tail load balancer cuts the sequence into 2*cp chunks, and
    SP then splits each rank's seq_length/cp tokens over tp."""
    cp, tp, seq = case.layout.cp, case.layout.tp, case.model.seq_length
    if cp > 1 and (seq % (2 * cp) or (seq // cp) % tp):
        raise ConfigError(f"seq_length={seq}: 2*cp={2 * cp} must divide it and tp={tp} "
                          f"seq_length/cp (torchtitan's head-tail CP sharding, then SP)")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _parallel_dims(dp: int, tp: int, device_type: str, ep: int = 1, cp: int = 1,
                   pp: int = 1):
    """torchtitan's meshes for pp x dp x cp x tp (ep: its expert-parallel degree, carved out
    of dp x tp; cp folds into its ``fsdp`` axis with dp). torchtitan 0.3.0 picks the mesh
    device type once, at import (``tools.utils.device_type``: the available accelerator,
    else "cuda"), so on a CPU-only host its meshes are "cuda" meshes and the first
    ``distribute_tensor`` fails ("Torch not compiled with CUDA enabled"); the module's copy
    is pointed at this rank's device before the meshes are built (a finding:
    scripts/torchtitan_cpu_findings.py)."""
    import torchtitan.distributed.parallel_dims as titan_dims  # optional dependency
    from torchtitan.distributed import ParallelDims
    titan_dims.device_type = device_type
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=cp, tp=tp, pp=pp, ep=ep,
                        world_size=pp * dp * cp * tp, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def titan_parallelize(parallelize_fn, model, dims):
    """``parallelize_fn`` (torchtitan's ``parallelize_llama`` or ``parallelize_deepseekv3``)
    on ``model`` over ``dims``, in fp32, with torchtitan's defaults otherwise."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    par = ParallelismConfig(data_parallel_shard_degree=dims.dp_shard,
                            tensor_parallel_degree=dims.tp, expert_parallel_degree=dims.ep,
                            context_parallel_degree=dims.cp,
                            spmd_backend="partial_dtensor")
    return parallelize_fn(model, parallel_dims=dims,
                          training=TrainingConfig(mixed_precision_param="float32"),
                          parallelism=par, compile_config=CompileConfig(),
                          ac_config=None, dump_folder="/tmp")


def _sum_over_gloo(model) -> None:
    """Keep torchtitan's gradient sum over dp on gloo. torchtitan disables FSDP2's division
    (``disable_fsdp_gradient_division``: ``set_gradient_divide_factor(1.0)``), and FSDP2 then
    reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which Gloo refuses ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo": a finding, scripts/torchtitan_cpu_findings.py). FSDP2's
    ``set_force_sum_reduction_for_comms`` makes the same sum with plain ``SUM``."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


@register
class TorchTitan(Scheme):
    name = "baseline.torchtitan"
    family = "hybrid"
    baseline_of = "hybrid"
    description = ("torchtitan 0.3.0 Llama3Model + parallelize_llama (TP+SP, FSDP2, CP) + "
                   "pipeline_llm (PP)")
    uses = ("dp", "tp", "cp", "pp")
    options = ("schedule", "vpp")
    model_features = MODEL_FEATURES - {"mla"}
    isolated = True  # torchtitan sets process-global state (its SPMD backend)

    #: the parbench <-> torchtitan weight mapping (a subclass for another model swaps it)
    to_titan = staticmethod(to_titan)
    from_titan = staticmethod(from_titan)

    def __init__(self, ctx):
        super().__init__(ctx)
        from torchtitan.distributed.utils import set_spmd_backend
        lay = ctx.layout
        set_spmd_backend("partial_dtensor")
        self.dims = _parallel_dims(lay.dp, lay.tp, ctx.device.type, ep=lay.ep, cp=lay.cp,
                                   pp=lay.pp)
        self.dp_rank = self.dims.get_mesh("batch").get_local_rank() if lay.dp > 1 else 0
        if lay.cp > 1 and ctx.device.type == "cpu":
            register_cpu_sdpa()  # before apply_cp_to_forward merges the handler table
        model = self.build_titan()
        ref = build_model(ctx.model, ctx.run.seed)
        weights = self.to_titan(ctx.model, {n: p.detach() for n, p in ref.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
        if lay.pp > 1:
            self.schedule, parts, self.pp_first, self.pp_last = build_pipeline(
                self, model, self.titan_cfg)
            self.model = torch.nn.ModuleList(parts)  # this rank's stages
        else:
            self.model = self.parallelize(model)
        if ctx.device.type == "cpu":
            _sum_over_gloo(self.model)
        self.params = list(self.model.parameters())
        self.local = [_local(p).detach() for p in self.params]
        self.opt = make_optimizer(self.local, ctx.run)

    def build_titan(self):
        """torchtitan's Llama 3 for the case, with its TP + SP sharding declared."""
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
        tcfg = self.titan_cfg = titan_config(self.ctx.model)
        set_llama3_sharding_config(tcfg, enable_sp=True)
        return tcfg.build()

    def parallelize(self, model):
        from torchtitan.models.llama3.parallelize import parallelize_llama
        return titan_parallelize(parallelize_llama, model, self.dims)

    def train_step(self, inputs, targets, step):
        from torchtitan.components.loss import cross_entropy_loss
        lay, dev = self.ctx.layout, self.ctx.device
        tokens = targets.numel()  # every rank holds the global batch
        x = dp_slice(inputs, self.dp_rank, lay.dp).to(dev)
        y = dp_slice(targets, self.dp_rank, lay.dp).to(dev)
        self.model.zero_grad(set_to_none=True)
        if lay.pp > 1:
            return self.pipeline_train_step(x, y, tokens)
        total = 0.0
        for i, (xm, ym) in enumerate(microbatches(x, y, lay.num_microbatches)):
            xm, ym, kwargs = self.shard_sequence(xm, ym)
            with self.ctx.timeline.span("F", mb=i):
                loss = cross_entropy_loss(self.model(xm, **kwargs), ym) / tokens
            with self.ctx.timeline.span("B", mb=i):
                loss.backward()
            total += float(loss.detach())
        with self.ctx.timeline.span("optim"):
            self.step_local()
        # the loss is summed over torchtitan's loss mesh (batch x cp: its fsdp axis here)
        loss_group = self.dims.get_mesh("fsdp").get_group() if lay.dp * lay.cp > 1 else None
        return self.reduce_loss(total, loss_group) if loss_group else total

    def pipeline_train_step(self, x, y, tokens: int) -> float:
        """torchtitan's pipeline schedule over the rank's batch, then the update; the loss
        summed over the last stage's dp ranks (each tp rank holds it, so divided by tp)."""
        x, y, kwargs = self.shard_sequence(x, y)  # every stage gets the positions
        total = pipeline_step(self, x, y, tokens, kwargs)
        with self.ctx.timeline.span("optim"):
            self.step_local()
        return self.reduce_loss(total) / self.ctx.layout.tp

    def shard_sequence(self, xm, ym):
        """A micro-batch as torchtitan's trainer feeds it (``post_dataloading_process``):
        under cp its tokens, labels and positions sharded along the sequence by
        ``prepare_context_parallel_input`` with the head-tail load balancer; else whole."""
        if self.dims.cp == 1:
            return xm, ym, {}
        from torchtitan.distributed.context_parallel import prepare_context_parallel_input
        pos = torch.arange(xm.shape[1], device=xm.device).expand_as(xm).contiguous()
        return prepare_context_parallel_input(xm, ym, {"positions": pos},
                                              self.dims.get_mesh("cp"), xm.device,
                                              "headtail")

    def step_local(self) -> None:
        """AdamW on the local shards of the (redistributed to their parameter's layout)
        gradients."""
        for p, loc in zip(self.params, self.local):
            g = p.grad
            if g is not None and hasattr(g, "placements") and g.placements != p.placements:
                g = g.redistribute(p.device_mesh, p.placements)
            loc.grad = _local(g) if g is not None else None
        self.opt.step()
        for loc in self.local:
            loc.grad = None

    def _full(self, grads: bool) -> dict[str, torch.Tensor]:
        """Unsharded tensors for the verdict, gathered outside the ledger (not training
        traffic), as ``baseline.dtensor.tp`` gathers them."""
        out = {}
        with comm.unrecorded():
            parts = self.model if self.ctx.layout.pp > 1 else [self.model]
            for name, p in (np for part in parts for np in part.named_parameters()):
                t = p.grad if grads else p
                t = torch.zeros_like(p) if t is None else t
                t = t.full_tensor() if hasattr(t, "full_tensor") else t
                out[name] = t.detach().float().clone()
        return self.from_titan(self.ctx.model, out)

    def full_params(self):
        return self._full(grads=False)

    def full_grads(self):
        return self._full(grads=True)

    @classmethod
    def unavailable(cls) -> str | None:
        return torchtitan_missing()

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        check_titan_case(case)
        missing = torchtitan_missing()
        if missing:
            raise ConfigError(f"scheme={cls.name}: {missing}")
