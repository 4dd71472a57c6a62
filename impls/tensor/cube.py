"""``tensor.3d`` (Bian et al. 2021, "Maximizing Parallelism in Distributed Training for Huge
Neural Networks"): the transformer's linears as 3-D matrix products on a q x q x q cube
(tp = q^3).

Rank (i, j, l) -- tp index l + q j + q^2 i; axes ``tp_x`` (i varies), ``tp_y`` (j) and
``tp_z`` (l). For a linear Y = X W with X of M tokens x K features and W of K x N (Bian et
al. Sec. 3.1; Colossal-AI's ``linear_3d``): the rank holds X_ijl (token block i, sub-block j;
feature block l: M/q^2 x K/q) and W_lji (feature block l of K; output block j of N, sub-block
i: K/q x N/q^2). Forward all-gathers X over ``tp_y`` (-> X_il) and W over ``tp_x`` (-> W_lj),
multiplies, and reduce-scatters the partial Y_ij over ``tp_z``: the rank keeps Y_ijl (token
block i, sub-block l; output block j). Backward all-gathers dY over ``tp_z``, and
reduce-scatters dX_il = dY_ij W_lj^T over ``tp_y`` and dW_lj = X_il^T dY_ij over ``tp_x`` (the
gathered X_il and W_lj are kept from forward, as Colossal-AI keeps them).

The output's token sub-block runs along z and its features along y: the next linear takes
its input that way, with the roles of y and z exchanged. So a layer alternates two layouts:
L1 (tokens i/j, features l: the residual stream, LayerNorms, embedding and head, whose
hidden group is ``tp_z``) and L2 (tokens i/l, features j: the QKV output and attention, the
MLP's hidden activation); QKV and fc1 go L1 -> L2, the projection and fc2 L2 -> L1. Token
blocks are whole sequences (b must divide by q^2), QKV's feature blocks whole heads (query
heads with their own K/V heads: q must divide num_kv_heads). Biases, norms and embeddings
hold one feature block and are replicated over the other two axes, whose gradients are
summed once per step (one coalesced all-reduce per axis; none over z without biases).
The LLaMA blocks run as in ``grid`` (``model_features``): RMSNorm over ``tp_z``, SwiGLU's
fc1 output block j = [gate_j; up_j] (its q sub-blocks gathered over ``tp_x`` back into it),
GQA, RoPE, no biases.
Predictions: ``parbench.analytic.tensor_grid.cube_step_traffic``.
"""
from __future__ import annotations

import torch

from parbench.analytic import shape_from
from parbench.analytic import tensor as tensor_model
from parbench.analytic import tensor_grid as grid_model
from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.scheme import Prediction, register

from .base import TensorParallelScheme
from .collectives import all_gather_dim0, reduce_scatter_dim0
from .grid import (GridGPT, activation_features, grid_out_rows, grid_probes, make_subgroup,
                   reduce_grads)
from .shards import Placement, blocks

#: linears from layout L1 to L2 (input features on z, output on y) and back
L1_TO_L2 = ("attn.qkv", "mlp.fc1")
L2_TO_L1 = ("attn.proj", "mlp.fc2")


class CubeGrid:
    def __init__(self, mesh, q: int):
        self.q = q
        t = mesh.index("tp")
        self.l, self.j, self.i = t % q, (t // q) % q, t // (q * q)

        def rank(tp, i, j, l):
            return tp[l + q * j + q * q * i]
        r = range(q)
        self.x, _ = make_subgroup(mesh, "tp_x", lambda tp: [
            [rank(tp, i, j, l) for i in r] for j in r for l in r])
        self.y, _ = make_subgroup(mesh, "tp_y", lambda tp: [
            [rank(tp, i, j, l) for j in r] for i in r for l in r])
        self.z, _ = make_subgroup(mesh, "tp_z", lambda tp: [
            [rank(tp, i, j, l) for l in r] for i in r for j in r])


class CubeLinear(torch.autograd.Function):
    """Y = X W (no bias) on the cube: ``x`` [tokens, K/q] gathered over ``in_group``,
    ``weight`` [N/q^2, K/q] gathered over ``w_group``, output reduce-scattered over
    ``out_group``."""

    @staticmethod
    def forward(ctx, x, weight, in_group, w_group, out_group, q):
        ctx.groups, ctx.q = (in_group, w_group, out_group), q
        xg = all_gather_dim0(x, in_group, q)
        wg = all_gather_dim0(weight, w_group, q)
        ctx.save_for_backward(xg, wg)
        return reduce_scatter_dim0(torch.matmul(xg, wg.t()), out_group, q)

    @staticmethod
    def backward(ctx, grad):
        xg, wg = ctx.saved_tensors
        in_group, w_group, out_group = ctx.groups
        q = ctx.q
        gg = all_gather_dim0(grad, out_group, q)
        grad_x = reduce_scatter_dim0(torch.matmul(gg, wg), in_group, q)
        gw = torch.matmul(gg.reshape(-1, gg.shape[-1]).t(), xg.reshape(-1, xg.shape[-1]))
        grad_w = reduce_scatter_dim0(gw, w_group, q)
        return grad_x, grad_w, None, None, None, None


class CubeGPT(GridGPT):
    def __init__(self, cfg, seed: int, grid: CubeGrid, tp_index: int):
        self.grid, self.q = grid, grid.q
        super().__init__(cfg, seed, tp_index)
        self.hidden_group = grid.z

    def rows(self, batch: int) -> slice:
        n = batch // (self.q * self.q)
        blk = self.grid.i * self.q + self.grid.j
        return slice(blk * n, (blk + 1) * n)

    def attention_rows(self, batch: int) -> slice:
        """Layout L2's rows: QKV's output keeps token sub-block l of block i (its
        reduce-scatter runs over z), so the attention of this rank's heads is over batch
        block i q + l, not the residual stream's i q + j."""
        n = batch // (self.q * self.q)
        blk = self.grid.i * self.q + self.grid.l
        return slice(blk * n, (blk + 1) * n)

    def placement(self, name: str, shape: tuple) -> Placement:
        q = self.q

        def block_of(n, b):
            return blocks(b * (n // q), n // q)

        def out_block(b):
            return grid_out_rows(self.cfg, q, name, shape[0], b)

        def out_sub(b, i):
            rows = out_block(b)
            n = rows.numel() // q
            return rows[i * n:(i + 1) * n]
        l1_to_l2 = any(f".{lin}." in name for lin in L1_TO_L2)
        l2_to_l1 = any(f".{lin}." in name for lin in L2_TO_L1)
        if l1_to_l2 or l2_to_l1:
            def feat_out(t):  # output features: y (j) for L1 -> L2, z (l) for L2 -> L1
                i, j, l = self.coords(t)
                return (j if l1_to_l2 else l), i, (l if l1_to_l2 else j)
            if name.endswith(".weight"):
                return Placement(name, shape, lambda t: (
                    out_sub(feat_out(t)[0], feat_out(t)[1]),
                    block_of(shape[1], feat_out(t)[2])))
            return Placement(name, shape, lambda t: (out_block(feat_out(t)[0]),))
        if name in ("embed.tok.weight", "head.out.weight", "embed.pos.weight"):
            return Placement(name, shape, lambda t: (None, block_of(shape[1],
                                                                    self.coords(t)[2])))
        return Placement(name, shape, lambda t: (block_of(shape[0], self.coords(t)[2]),))

    def linear(self, x, prefix: str):
        g = self.grid
        if any(prefix.endswith(lin) for lin in L1_TO_L2):
            groups = (g.y, g.x, g.z)
        else:
            groups = (g.z, g.x, g.y)
        y = CubeLinear.apply(x, self.p(f"{prefix}.weight"), *groups, self.q)
        return self.add_bias(y, f"{prefix}.bias")

    def weights(self) -> list:
        return [self.p(f"blocks.{i}.{lin}.weight") for i in range(self.cfg.num_layers)
                for lin in L1_TO_L2 + L2_TO_L1]

    def y_feature_params(self) -> list:
        """Biases whose features run along y (outputs of the L1 -> L2 linears; none
        without biases)."""
        return [self.p(f"blocks.{i}.{lin}.bias") for i in range(self.cfg.num_layers)
                for lin in L1_TO_L2 if self.cfg.bias]


@register
class Cube3D(TensorParallelScheme):
    name = "tensor.3d"
    description = "3D tensor parallelism (Bian et al. 2021) on a q x q x q cube"
    options = ()
    model_cls = CubeGPT
    #: clips by global norm (``TensorParallelScheme.clip``): every weight block is one
    #: rank's; a bias / LayerNorm / embedding block counted on its first holder, summed over tp
    supports_clip_grad = True
    #: a masked loss: each batch block's summed loss over the micro-batch's counted tokens
    #: (``GridGPT.token_count``), scaled by their share of the global count
    #: (``TensorParallelScheme.loss_scale``; Megatron-LM's --calculate-per-token-loss)
    supports_loss_mask = True
    #: packed documents: a rank holds whole sequences of its token block and finds their
    #: documents in its tokens (``GridGPT.forward``; Megatron's --reset-attention-mask /
    #: --reset-position-ids)
    supports_packing = True
    #: the LLaMA blocks (``grid``): RMSNorm over the hidden group, no biases, SwiGLU's
    #: [gate_j; up_j] blocks, GQA with q dividing num_kv_heads, RoPE
    model_features = MODEL_FEATURES
    #: the default cases (``parbench verify scheme=tensor.3d``): a 2 x 2 x 2 cube, the batch
    #: split q^2 ways, tp = 8 dividing the heads
    default_fields = {"tp": 8, "micro_batch_size": 4, "num_heads": 8, "hidden_size": 64,
                      "ffn_hidden_size": 104}

    def build_model(self):
        ctx = self.ctx
        q = grid_model.cube_grid(ctx.layout.tp)
        self.grid = CubeGrid(ctx.mesh, q)
        return self.model_cls(ctx.model, ctx.run.seed, self.grid, self.tp_rank).to(ctx.device)

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m, p = case.model, case.layout
        try:
            grid_model.check_cube(shape_from(m), p.micro_batch_size,
                                    grid_model.cube_grid(p.tp))
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
        on_y = {id(b) for b in self.model.y_feature_params()}
        replicated = [p for p in self.params if id(p) not in weights]
        reduce_grads(replicated, self.grid.x)
        reduce_grads([p for p in replicated if id(p) not in on_y], self.grid.y)
        reduce_grads([p for p in replicated if id(p) in on_y], self.grid.z)

    def train_step(self, inputs, targets, step):
        total = super().train_step(inputs, targets, step)
        return self.reduce_loss(total, self.group) / self.grid.q

    def activation_formula(self) -> dict:
        m, p = self.ctx.model, self.ctx.layout
        return {"act_layer_formula": grid_model.cube_layer_activation_bytes(
            m.seq_length, p.micro_batch_size, m.hidden_size, m.num_heads, self.grid.q,
            m.ffn, **activation_features(m))}

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        m, p = case.model, case.layout
        q = grid_model.cube_grid(p.tp)
        shape = shape_from(m)
        transfers = grid_model.cube_step_traffic(shape, p.micro_batch_size, q,
                                                 p.num_microbatches,
                                                 clip_grad=case.run.clip_grad)
        wire, calls = tensor_model.per_rank(transfers, p.tp)
        states = tensor_model.model_states(grid_model.cube_params(shape, q),
                                           case.run.optimizer)
        return Prediction(wire_bytes=wire, calls=calls,
                          model_state_bytes=[dict(states) for _ in range(p.tp)],
                          figures={"grid": {"q": q},
                                   "transfers": [t.as_dict() for t in transfers]})
