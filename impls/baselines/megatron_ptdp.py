"""Megatron-Core 0.16's own PTD-P beside ``hybrid``: ``baseline.megatron.ptdp`` runs the
hybrid suite's PTD-P case (tp x dp x pp, 1F1B) with Megatron-Core's machinery end to end.

- **Groups**: ``parallel_state.initialize_model_parallel(tp, pp)`` on the gloo world. Each of
  its groups (tp, pp, dp, dp-cp, cp, mp, tp-cp, tp-dp-cp and the expert groups) is checked
  to hold exactly this rank's mesh group of the same name -- a mismatch raises, naming the
  group and both rank lists -- and every handle ``parallel_state`` keeps of it (its aliases
  included, e.g. the partial data-parallel group) is then swapped for the mesh's handle with
  those members, so that Megatron's traffic lands in the ledger under the mesh's axis names.
  The membership is Megatron's; only the communicator objects are the mesh's.
- **Layers**: each pipeline stage is ``megatron_tp.MegatronCoreGPT`` (Megatron-Core's
  ``VocabParallelEmbedding``, ``ColumnParallelLinear``, ``RowParallelLinear`` and
  ``vocab_parallel_cross_entropy``) holding layers [r L/p, (r+1) L/p) of pp rank r, the
  embedding on the first stage and the final LayerNorm and head on the last, filled from the
  reference model's shards. Unlike Megatron's ``TransformerBlock`` the stage drops the
  received activation (``set_input_tensor``) after the schedule, so that the model states
  between steps are parameters, gradients and optimizer states only.
- **Schedule**: ``schedules.get_forward_backward_func()`` -- with pp > 1 and no virtual
  stages, ``forward_backward_pipelining_without_interleaving`` (1F1B) -- with its
  ``P2PCommunicator`` (batched ``isend`` / ``irecv`` of ``[s, b, h]`` fp32 tensors, shapes from
  the config, no shape exchange), ``deallocate_pipeline_outputs`` (its pseudo-freeing of sent
  outputs and its ``custom_backward``) and the loss scaled by 1/m in its
  ``forward_step_calc_loss``.
- **Gradients**: Megatron-Core's ``DistributedDataParallel`` (it runs on the CPU): one
  contiguous fp32 gradient buffer per stage (``main_grad``), filled by its
  gradient-accumulator hooks, scaled by 1/dp and all-reduced in one bucket over its
  data-parallel group with context parallelism (the mesh's ``dp_cp``) by
  ``finalize_model_grads`` (the schedule's ``finalize_model_grads_func``), which also runs its
  embedding and LayerNorm reductions (nothing to do here: untied embeddings, no sequence
  parallelism). Megatron's optimizer is not used: the run's AdamW
  (``parbench.model.make_optimizer``) steps each parameter with its ``main_grad``. With
  ``clip_grad`` the norm is Megatron-Core's (``_clip``: its parameter filters, its
  ``get_grad_norm_fp32`` over its model-parallel group).

CPU shims, installed only on a CPU-only torch in these (``isolated``) rank processes; none
changes Megatron's arithmetic:

1. ``torch.cuda.current_device`` answers ``"cpu"`` (``megatron_tp.point_current_device_at_cpu``):
   ``P2PCommunicator._communicate`` creates its receive buffers and ``_ParamAndGradBuffer`` its
   gradient buffer on it;
2. while the schedule runs, a ``TorchFunctionMode`` turns a ``device="cuda"`` argument of a
   torch function into the CPU: ``forward_backward_pipelining_without_interleaving`` creates
   its token counter with ``torch.zeros([], dtype=torch.int, device="cuda")``
   (schedules.py), which raises "Torch not compiled with CUDA enabled".

Config choices that keep CUDA out without a shim: ``batch_p2p_sync=False`` (otherwise
``_communicate`` calls ``torch.cuda.synchronize()`` after every batched p2p, a guard Megatron
documents for old PyTorch), ``pipeline_dtype=float32``, ``overlap_grad_reduce=False`` (no
communication stream), ``gradient_accumulation_fusion=False``.

Traffic: the same transfers as ``hybrid`` on this case -- per micro-batch one ``[s, b, h]``
send forward and one backward between the stages; per layer Megatron 1D's tp all-reduces; the
embedding's forward all-reduce and the cross-entropy's three; one all-reduce of the stage's
gradients over dp -- so ``predict`` is ``parbench.analytic.hybrid``'s closed form for the same
configuration. Measured: Megatron's wire bytes, calls and model states equal it on every rank
and step (tp = dp = pp = 2 on tiny-4l; also tp = dp = 2 with pp = 1, where
``get_forward_backward_func`` returns ``forward_backward_no_pipelining``, and pp = 2 alone);
for a baseline a difference would be a finding, shown, not a failure.

Optional: ``pip install -e ".[megatron]"``; without megatron-core the scheme reports itself
unavailable and suites skip it with that reason.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from parbench.batching import dp_slice, microbatches
from parbench.config import CaseConfig, ConfigError
from parbench.model import make_optimizer, scale_grads_, stage_layers
from parbench.scheme import Scheme, register, registered

from impls.baselines.megatron_tp import (MegatronCoreBaseline, MegatronCoreGPT,
                                         point_current_device_at_cpu)
from impls.tensor.base import TensorParallelScheme

#: mesh axis -> Megatron-Core's getter of the same group
MEGATRON_GROUPS = {
    "tp": ("get_tensor_model_parallel_group", {}),
    "pp": ("get_pipeline_model_parallel_group", {}),
    "dp": ("get_data_parallel_group", {}),
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "cp": ("get_context_parallel_group", {}),
    "mp": ("get_model_parallel_group", {}),
    "tp_cp": ("get_tensor_and_context_parallel_group", {}),
    "tp_dp_cp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    "ep": ("get_expert_model_parallel_group", {}),
    "etp": ("get_expert_tensor_parallel_group", {}),
    "edp": ("get_expert_data_parallel_group", {}),
}


def swap_group(theirs, mine) -> None:
    """Every handle ``parallel_state`` keeps of its group ``theirs`` (aliases included)
    replaced by the mesh's ``mine`` of the same members, so the traffic lands in the ledger
    under the mesh's axis name."""
    from megatron.core import parallel_state as ps
    for name, value in list(vars(ps).items()):
        if value is theirs:
            setattr(ps, name, mine)


def adopt_mesh_groups(mesh) -> None:
    """Check Megatron-Core's groups against the mesh's, then make ``parallel_state`` hold
    the mesh's handles (module docstring, "Groups")."""
    from megatron.core import parallel_state as ps
    for axis, (getter, kw) in MEGATRON_GROUPS.items():
        theirs = getattr(ps, getter)(**kw)
        members = dist.get_process_group_ranks(theirs)
        if members != mesh.ranks(axis):
            raise RuntimeError(f"rank {mesh.rank}: Megatron-Core's {getter}({kw}) holds ranks "
                               f"{members}, the mesh's {axis} group {mesh.ranks(axis)}")
        swap_group(theirs, mesh.group(axis))


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Shim 2: ``device="cuda"`` in a torch function call means the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


class MegatronCoreStage(MegatronCoreGPT):
    """A pipeline stage as Megatron's schedule drives it: ``set_input_tensor`` gives the
    received activation, ``forward(tokens, targets)`` returns the stage output (the mean
    token loss on the last stage)."""

    def __init__(self, cfg, seed, group, tp, rank, stage, config):
        from megatron.core.enums import ModelType
        super().__init__(cfg, seed, group, tp, rank, sp=False, stage=stage, conf=config)
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.pre_process, self.post_process = self.first, self.last
        self.share_embeddings_and_output_weights = False
        self.input_tensor = None

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, tokens, targets):
        x = self.layers(self.embed(tokens) if self.first else self.input_tensor)
        return self.head(x, targets) if self.last else x


def _loss_func(loss):
    """Megatron's two-value loss function: the schedule scales the loss by 1/m."""
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    tokens, targets = next(data_iterator)
    return model(tokens, targets), _loss_func


@register
class MegatronCorePTDP(MegatronCoreBaseline, Scheme):
    name = "baseline.megatron.ptdp"
    family = "hybrid"
    baseline_of = "hybrid"
    supports_clip_grad = True
    description = ("Megatron-Core 0.16 PTD-P: initialize_model_parallel, tensor-parallel "
                   "layers, 1F1B forward_backward_pipelining_without_interleaving, its DDP")
    uses = ("tp", "dp", "pp")
    options = ("schedule",)
    #: whether a tied head on the last stage is run (Megatron's embedding group)
    ties_across_stages = False
    #: the CPU-only torch function mode the schedule runs in (shim 2)
    cpu_mode = _CudaFactoriesOnCpu

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p, m = case.layout, case.model
        if p.schedule != "1f1b":
            raise ConfigError(f"schedule={p.schedule!r}: {cls.name} runs Megatron-Core's "
                              "non-interleaved schedule (1f1b)")
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype!r} is not supported by {cls.name} "
                              "(fp32 only)")
        if p.pp > 1 and m.tie_embeddings and not cls.ties_across_stages:
            raise ConfigError(f"tie_embeddings=true with pp > 1 is not supported by "
                              f"{cls.name} (as by hybrid)")
        if m.num_layers % p.pp:
            raise ConfigError(f"pp={p.pp} does not divide num_layers={m.num_layers}")

    @classmethod
    def predict(cls, case: CaseConfig):
        """``hybrid``'s closed form for the same configuration (module docstring)."""
        return registered(cls.baseline_of).predict(case)

    def __init__(self, ctx):
        super().__init__(ctx)
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
        mesh, cfg, par = ctx.mesh, ctx.model, ctx.layout
        point_current_device_at_cpu(ctx.device)  # shim 1
        ps.initialize_model_parallel(tensor_model_parallel_size=par.tp,
                                     pipeline_model_parallel_size=par.pp,
                                     context_parallel_size=par.cp,
                                     create_gloo_process_groups=False)
        adopt_mesh_groups(mesh)
        self.tp, self.dp, self.pp = par.tp, par.dp, par.pp
        self.group, self.tp_rank = mesh.group("tp"), mesh.index("tp")
        self.dp_rank, self.m = mesh.index("dp"), par.num_microbatches
        config = self.transformer_config(cfg, par)
        r = ps.get_pipeline_model_parallel_rank()
        lo, hi = stage_layers(cfg.num_layers, par.pp, r)
        self.model = self.build_stage(config, (lo, hi, r == 0, r == par.pp - 1)
                                      ).to(ctx.device)
        self.ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(overlap_grad_reduce=False,
                                                  use_distributed_optimizer=False),
            self.model)
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.forward_backward = get_forward_backward_func()
        cpu_only = torch.device(ctx.device).type == "cpu" and not torch.cuda.is_available()
        self.factories = self.cpu_mode if cpu_only else contextlib.nullcontext  # shim 2
        self.params = list(self.model.parameters())
        self.opt = make_optimizer(self.params, ctx.run)

    def transformer_config(self, cfg, par):
        """Megatron's config of the pipeline (what the schedule and its DDP read)."""
        from megatron.core.transformer.transformer_config import TransformerConfig
        return TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_heads, ffn_hidden_size=cfg.ffn,
            tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
            pipeline_dtype=torch.float32, params_dtype=torch.float32,
            use_cpu_initialization=True, perform_initialization=False,
            gradient_accumulation_fusion=False, deallocate_pipeline_outputs=True,
            batch_p2p_comm=True, batch_p2p_sync=False)

    def build_stage(self, config, stage):
        """This rank's stage (lo, hi, first, last) as the schedule drives it."""
        return MegatronCoreStage(self.ctx.model, self.ctx.run.seed, self.group, self.tp,
                                 self.tp_rank, stage, config)

    def train_step(self, inputs, targets, step):
        cfg, par, dev, tl = self.ctx.model, self.ctx.layout, self.ctx.device, self.ctx.timeline
        x = dp_slice(inputs, self.dp_rank, self.dp).to(dev)
        y = dp_slice(targets, self.dp_rank, self.dp).to(dev)
        for p in self.params:
            p.grad = None  # the last step's .grad is main_grad itself (below)
        self.ddp.zero_grad_buffer()
        with tl.span("pipeline"), self.factories():
            out = self.forward_backward(
                forward_step_func=_forward_step, data_iterator=iter(microbatches(x, y, self.m)),
                model=[self.ddp], num_microbatches=self.m, seq_length=cfg.seq_length,
                micro_batch_size=par.micro_batch_size, forward_only=False)
        self.model.input_tensor = None  # the schedule is done with the received activation
        for p in self.params:
            p.grad = p.main_grad
        with tl.span("optim"):
            self._clip()
            self.opt.step()
        loss = sum(float(d["lm loss"]) for d in out) / self.m if self.model.last else 0.0
        return self.reduce_loss(loss) / (self.tp * self.dp * par.cp)

    def _clip(self) -> None:
        """``clip_grad``: Megatron-Core's own norm -- the gradients its optimizer counts
        (``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``: a parameter
        replicated over tp on tp rank 0 only) through ``get_grad_norm_fp32``, all-reduced over
        its model-parallel group (tp x pp, the mesh's ``mp``) -- and its factor max_norm /
        (norm + 1e-6) when below 1. Shim 3: ``clip_grad_by_total_norm_fp32`` asserts CUDA
        tensors, so on a CPU-only torch the factor is applied here; on CUDA Megatron's own
        function applies it."""
        clip = self.ctx.run.clip_grad
        if not clip:
            return
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer.clip_grads import (clip_grad_by_total_norm_fp32,
                                                        get_grad_norm_fp32)
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared
        counted = [p.grad for p in self.params
                   if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        with self.factories():
            norm = get_grad_norm_fp32(counted,
                                      grad_stats_parallel_group=ps.get_model_parallel_group())
        if torch.cuda.is_available():
            clip_grad_by_total_norm_fp32(self.params, clip, norm)
        else:
            coef = clip / (norm + 1.0e-6)
            scale_grads_([p.grad for p in self.params], coef if coef < 1.0 else 1.0)

    # the verdict's view: the stage's shards gathered over tp, as the tensor baselines do
    _full = TensorParallelScheme._full
    full_params = TensorParallelScheme.full_params
    full_grads = TensorParallelScheme.full_grads
