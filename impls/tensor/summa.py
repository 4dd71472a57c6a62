"""``tensor.2d`` (SUMMA / Optimus, Xu et al. 2021) and ``tensor.2.5d`` (Tesseract, Wang et al.
2021): the transformer's linears as SUMMA matrix products on a q x q grid, repeated over d
depth layers (tp = q^2 d; 2D is d = 1).

Rank (k, i, j) -- depth k, grid row i, grid column j; tp index j + q i + q^2 k, so the row
group (same k, i) is q consecutive ranks inside Megatron's tp group -- holds, for activations
X of B tokens x H features, the block of batch block k q + i (whole sequences: b must divide
by d q) and hidden block j; for a weight W (H_in x H_out, stored as torch's [out, in]) the
block (row block i of H_in, column block j of H_out), the same on every depth layer
(Tesseract, Sec. 3.1: the weight is split q x q and replicated d times).

One linear Y = X W (van de Geijn & Watts 1997, SUMMA; Xu et al. Sec. 3.2, Algorithm 1):
forward, for l = 0..q-1, X_il is broadcast along grid row i and W_lj along grid column j,
and Y_ij += X_il W_lj. Backward computes dX = dY W^T and dW = X^T dY as two more SUMMA
products (Optimus' ``Matmul_ABT`` / ``Matmul_ATB``): for each l, W_lj is broadcast along the
column and the partial dY_ij W_lj^T reduced along the row to (i, l); X_il is broadcast along
the row and the partial X_il^T dY_ij reduced along the column to (l, j). Depth layers
compute the same weight's gradient from different batch blocks: every gradient is
all-reduced over the depth group once per step (Tesseract, Sec. 3.2).

QKV's output blocks are head-aligned (grid column j holds the Q rows of heads
[j a/q, (j+1) a/q) and the K and V rows of their K/V heads [j g/q, (j+1) g/q): q must divide
num_kv_heads), so attention is local; norms, embeddings and the LM head as in ``grid``.
The model runs the GPT-2 blocks and the LLaMA blocks (``model_features``: RoPE, GQA, SwiGLU
with fc1's column block j = [gate_j; up_j], RMSNorm over the grid row, no biases; ``grid``).
Axes: ``tp_row``, ``tp_col``, ``tp_dep``. Predictions:
``parbench.analytic.tensor_grid.summa_step_traffic``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.analytic import shape_from
from parbench.analytic import tensor as tensor_model
from parbench.analytic import tensor_grid as grid_model
from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.scheme import Prediction, register

from .base import TensorParallelScheme
from .grid import (GridGPT, activation_features, grid_out_rows, grid_probes, make_subgroup,
                   reduce_grads)
from .shards import Placement, blocks

LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


class SummaGrid:
    """Coordinates and groups of one rank of the q x q x d grid."""

    def __init__(self, mesh, q: int, d: int):
        self.q, self.d = q, d
        t = mesh.index("tp")
        self.j, self.i, self.k = t % q, (t // q) % q, t // (q * q)

        def rank(tp, k, i, j):
            return tp[j + q * i + q * q * k]
        self.row, self.row_ranks = make_subgroup(
            mesh, "tp_row", lambda tp: [[rank(tp, k, i, j) for j in range(q)]
                                             for k in range(d) for i in range(q)])
        self.col, self.col_ranks = make_subgroup(
            mesh, "tp_col", lambda tp: [[rank(tp, k, i, j) for i in range(q)]
                                             for k in range(d) for j in range(q)])
        self.dep, self.dep_ranks = make_subgroup(
            mesh, "tp_dep", lambda tp: [[rank(tp, k, i, j) for k in range(d)]
                                             for i in range(q) for j in range(q)])


class SummaLinear(torch.autograd.Function):
    """Y = X W on the grid: ``x`` is X_ij [..., H_in/q], ``weight`` W_ij^T [H_out/q, H_in/q]."""

    @staticmethod
    def forward(ctx, x, weight, grid: SummaGrid):
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        a = x.reshape(-1, x.shape[-1])
        b = weight.t()
        out = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        for l in range(grid.q):
            al = a.contiguous() if grid.j == l else torch.empty_like(a)
            dist.broadcast(al, src=grid.row_ranks[l], group=grid.row)
            bl = b.contiguous() if grid.i == l else torch.empty(b.shape, dtype=b.dtype,
                                                                device=b.device)
            dist.broadcast(bl, src=grid.col_ranks[l], group=grid.col)
            out.addmm_(al, bl)
        return out.view(*x.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grid = ctx.grid
        a = x.reshape(-1, x.shape[-1])
        b = weight.t()
        g = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_x = grad_w = None
        for l in range(grid.q):  # dX_il = sum_j dY_ij W_lj^T
            bl = b.contiguous() if grid.i == l else torch.empty(b.shape, dtype=b.dtype,
                                                                device=b.device)
            dist.broadcast(bl, src=grid.col_ranks[l], group=grid.col)
            part = torch.matmul(g, bl.t())
            dist.reduce(part, dst=grid.row_ranks[l], group=grid.row)
            if grid.j == l:
                grad_x = part
        for l in range(grid.q):  # dW_lj = sum_i X_il^T dY_ij
            al = a.contiguous() if grid.j == l else torch.empty_like(a)
            dist.broadcast(al, src=grid.row_ranks[l], group=grid.row)
            part = torch.matmul(al.t(), g)
            dist.reduce(part, dst=grid.col_ranks[l], group=grid.col)
            if grid.i == l:
                grad_w = part
        return grad_x.view_as(x), grad_w.t(), None


class SummaGPT(GridGPT):
    def __init__(self, cfg, seed: int, grid: SummaGrid, tp_index: int):
        self.grid = grid
        self.q, self.d = grid.q, grid.d
        super().__init__(cfg, seed, tp_index)
        self.hidden_group = grid.row

    def rows(self, batch: int) -> slice:
        n = batch // (self.d * self.q)
        blk = self.grid.k * self.q + self.grid.i
        return slice(blk * n, (blk + 1) * n)

    def placement(self, name: str, shape: tuple) -> Placement:
        q = self.q

        def block_of(n, j):
            return blocks(j * (n // q), n // q)

        def out_rows(j):
            return grid_out_rows(self.cfg, q, name, shape[0], j)
        if name.endswith(".weight") and any(f".{lin}." in name for lin in LINEARS):
            return Placement(name, shape, lambda t: (out_rows(self.coords(t)[2]),
                                                     block_of(shape[1], self.coords(t)[1])))
        if name.endswith(".bias") and any(f".{lin}." in name for lin in LINEARS):
            return Placement(name, shape, lambda t: (out_rows(self.coords(t)[2]),))
        if name in ("embed.tok.weight", "head.out.weight", "embed.pos.weight"):
            return Placement(name, shape, lambda t: (None, block_of(shape[1],
                                                                    self.coords(t)[2])))
        # LayerNorms: the hidden block of grid column j
        return Placement(name, shape, lambda t: (block_of(shape[0], self.coords(t)[2]),))

    def linear(self, x, prefix: str):
        y = SummaLinear.apply(x, self.p(f"{prefix}.weight"), self.grid)
        return self.add_bias(y, f"{prefix}.bias")

    def weights(self) -> list:
        return [self.p(f"blocks.{i}.{lin}.weight") for i in range(self.cfg.num_layers)
                for lin in LINEARS]


@register
class Tesseract(TensorParallelScheme):
    name = "tensor.2.5d"
    description = "2.5D tensor parallelism (Tesseract): SUMMA on a q x q grid x d layers"
    options = ("tp_depth",)
    model_cls = SummaGPT
    #: clips by global norm (``TensorParallelScheme.clip``): each weight block counted on
    #: depth layer 0, each hidden block on grid row 0 of layer 0, summed over tp
    supports_clip_grad = True
    #: a masked loss: each batch block's summed loss over the micro-batch's counted tokens
    #: (``GridGPT.token_count``), scaled by their share of the global count
    #: (``TensorParallelScheme.loss_scale``; Megatron-LM's --calculate-per-token-loss)
    supports_loss_mask = True
    #: packed documents: a rank holds whole sequences of its batch block and finds their
    #: documents in its tokens (``GridGPT.forward``; Megatron's --reset-attention-mask /
    #: --reset-position-ids)
    supports_packing = True
    #: the LLaMA blocks (``grid``): RMSNorm over the hidden group, no biases, SwiGLU's
    #: [gate_j; up_j] blocks, GQA with q dividing num_kv_heads, RoPE
    model_features = MODEL_FEATURES
    #: the default cases (``parbench verify scheme=tensor.2.5d``): a 2 x 2 grid two layers
    #: deep, whole sequences per batch block (b a multiple of q d), and tp = 8 dividing the
    #: heads (the layout rule every tensor scheme keeps)
    default_fields = {"tp": 8, "tp_depth": 2, "micro_batch_size": 4, "num_heads": 8,
                      "hidden_size": 64, "ffn_hidden_size": 104}

    @classmethod
    def grid_shape(cls, case: CaseConfig) -> tuple[int, int]:
        return grid_model.summa_grid(case.layout.tp, case.options.tensor.tp_depth)

    def build_model(self):
        ctx = self.ctx
        q, d = self.grid_shape(ctx.case)
        self.grid = SummaGrid(ctx.mesh, q, d)
        return self.model_cls(ctx.model, ctx.run.seed, self.grid, self.tp_rank).to(ctx.device)

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m, p = case.model, case.layout
        try:
            q, d = cls.grid_shape(case)
            grid_model.check_summa(shape_from(m), p.micro_batch_size, q, d)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if case.options.recompute != "none":
            raise ConfigError(f"recompute={case.options.recompute} is not used by {cls.name} "
                              "(none only)")

    def module_probes(self):
        """The grid rank's batch block and hidden block of each reference module
        (``grid.grid_probes``)."""
        return grid_probes(self.model, self.ctx.layout)

    def after_backward(self) -> None:
        weights = {id(w) for w in self.model.weights()}
        reduce_grads([p for p in self.params if id(p) not in weights], self.grid.col)
        reduce_grads(self.params, self.grid.dep)

    def train_step(self, inputs, targets, step):
        total = super().train_step(inputs, targets, step)
        return self.reduce_loss(total, self.group) / self.grid.q

    def activation_formula(self) -> dict:
        m, p = self.ctx.model, self.ctx.layout
        return {"act_layer_formula": grid_model.summa_layer_activation_bytes(
            m.seq_length, p.micro_batch_size, m.hidden_size, m.num_heads, self.grid.q,
            self.grid.d, m.ffn, **activation_features(m))}

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        m, p = case.model, case.layout
        q, d = cls.grid_shape(case)
        shape = shape_from(m)
        transfers = grid_model.summa_step_traffic(shape, p.micro_batch_size, q, d,
                                                  p.num_microbatches,
                                                  clip_grad=case.run.clip_grad)
        wire, calls = tensor_model.per_rank(transfers, p.tp)
        states = tensor_model.model_states(grid_model.summa_params(shape, q),
                                           case.run.optimizer)
        return Prediction(wire_bytes=wire, calls=calls,
                          model_state_bytes=[dict(states) for _ in range(p.tp)],
                          figures={"grid": {"q": q, "d": d},
                                   "transfers": [t.as_dict() for t in transfers],
                                   "paper": grid_model.summa_paper_traffic(
                                       shape, p.micro_batch_size, q, d,
                                       p.num_microbatches)})


@register
class Optimus(Tesseract):
    name = "tensor.2d"
    description = "2D tensor parallelism (SUMMA / Optimus) on a q x q grid, tp = q^2"
    options = ()
    #: the default cases: a 2 x 2 grid, two sequences per micro-batch (one per batch block)
    default_fields = {"tp": 4, "micro_batch_size": 2}

    @classmethod
    def grid_shape(cls, case: CaseConfig) -> tuple[int, int]:
        return grid_model.summa_grid(case.layout.tp, 1)
