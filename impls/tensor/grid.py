"""What the multi-dimensional tensor-parallel schemes (2D / 2.5D SUMMA, 3D) share.

Their activations are partitioned both ways (Xu et al. 2021, Sec. 3; Wang et al. 2021,
Sec. 3; Bian et al. 2021, Sec. 3): a rank holds whole sequences of one batch block (so the
causal attention of its heads is local) and one block of the hidden dimension. Around the
parallel linears the model is handled as the papers' layers handle it:

- LayerNorm over a hidden dimension split across the *hidden group* (the ranks holding the
  other hidden blocks of the same tokens): the mean and the variance are all-reduced over it
  (2 all-reduces of one fp32 value per token forward, their conjugates backward; Optimus'
  ``LayerNorm2D``); gamma and beta hold the rank's hidden block;
- the token and position embeddings hold the rank's hidden block of every row (no
  vocabulary split, so no padding); a lookup is local;
- the LM head uses the same block of the (possibly tied) embedding: each rank's partial
  logits over the whole vocabulary are all-reduced over the hidden group (``g``), and the
  cross-entropy of the rank's tokens is computed locally (the hidden group computes it
  q times, identically), summed and divided by the micro-batch's counted tokens;
- parameters replicated over some axes (LayerNorms, biases, embeddings, and every parameter
  across the 2.5D depth) have their gradients summed over those axes once per step, each
  axis's in one coalesced all-reduce.

``GridGPT`` holds the parameters by their full names with a placement each (index functions
of the tp index) and runs the reference model's forward with a subclass's ``linear``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parbench.model import build_model, counted_tokens

from .collectives import AllReduceSum, ReduceFromRegion
from .shards import Placement, take


def make_subgroup(mesh, name: str, members_of) -> tuple[object, list[int]]:
    """This rank's group of the partition of every tp group into ``members_of(tp_ranks)``
    (lists of global ranks), created once per mesh as axis ``name`` (the ledger's axis).
    Returns (group, its ranks in group order)."""
    partition = [m for tp_ranks in mesh.layout.groups("tp") for m in members_of(tp_ranks)]
    pg = mesh.subgroup(name, partition)
    mine = next(sorted(m) for m in partition if mesh.rank in m)
    return pg, mine


def grid_layer_norm(x: torch.Tensor, weight, bias, group, hidden: int,
                    eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm of ``x`` whose last dimension is one block of ``hidden`` split over
    ``group`` (two all-reduces of per-token sums)."""
    mean = AllReduceSum.apply(x.sum(-1, keepdim=True), group) / hidden
    xc = x - mean
    var = AllReduceSum.apply((xc * xc).sum(-1, keepdim=True), group) / hidden
    return xc * torch.rsqrt(var + eps) * weight + bias


def local_attention(qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Causal attention of local heads: [b, s, 3 heads hd] (Q, K, V blocks) -> [b, s, heads hd]."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, 3, heads, head_dim).unbind(2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2).reshape(b, s, heads * head_dim)


class GridGPT(nn.Module):
    """Parameters of one grid rank, named as in the reference model. Subclasses give
    ``placement(name, shape)``, ``linear(x, name)``, ``rows`` (this rank's batch block:
    a slice of sequences), the hidden group and ``head_dim``/``heads``."""

    hidden_group = None
    q: int = 1

    def coords(self, t: int) -> tuple[int, int, int]:
        """The (slowest, middle, fastest) grid coordinates of tp index ``t`` on q x q x .."""
        q = self.q
        return t // (q * q), (t // q) % q, t % q

    def __init__(self, cfg, seed: int, tp_index: int):
        super().__init__()
        self.cfg, self.tp_index = cfg, tp_index
        full = build_model(cfg, seed)
        self.placements: dict[str, Placement] = {}
        self._params = nn.ParameterDict()
        for name, p in full.named_parameters():
            pl = self.placement(name, tuple(p.shape))
            self.placements[name] = pl
            local = p.detach().clone() if pl.replicated else take(p.detach(),
                                                                 pl.index(tp_index))
            self._params[name.replace(".", "__")] = nn.Parameter(local)
        del full
        self.layer_probe = None

    def placement(self, name: str, shape: tuple) -> Placement:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        raise NotImplementedError

    def p(self, name: str) -> nn.Parameter:
        return self._params[name.replace(".", "__")]

    def shards(self):
        return {n: (self.p(n), pl) for n, pl in self.placements.items()}

    # ---- forward -----------------------------------------------------------------------
    def layer_norm(self, x, prefix: str, group=None):
        return grid_layer_norm(x, self.p(f"{prefix}.weight"), self.p(f"{prefix}.bias"),
                               group if group is not None else self.hidden_group,
                               self.cfg.hidden_size)

    def embed(self, tokens):
        x = F.embedding(tokens, self.p("embed.tok.weight"))
        if self.cfg.position_embeddings:
            x = x + self.p("embed.pos.weight")[: tokens.shape[1]]
        return x

    def block(self, i: int, x):
        pre = f"blocks.{i}"
        qkv = self.linear(self.layer_norm(x, f"{pre}.ln1"), f"{pre}.attn.qkv")
        attn = local_attention(qkv, self.heads, self.cfg.hidden_size // self.cfg.num_heads)
        x = x + self.linear(attn, f"{pre}.attn.proj")
        u = F.gelu(self.linear(self.layer_norm(x, f"{pre}.ln2"), f"{pre}.mlp.fc1"))
        return x + self.linear(u, f"{pre}.mlp.fc2")

    def head(self, x, targets):
        """Partial logits over the whole vocabulary from this hidden block, summed over the
        hidden group; the summed loss of this rank's tokens (the caller divides by all)."""
        w = self.p("embed.tok.weight") if self.cfg.tie_embeddings else self.p("head.out.weight")
        logits = torch.matmul(self.layer_norm(x, "head.ln"), w.t())
        logits = ReduceFromRegion.apply(logits, self.hidden_group)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="sum")

    def forward(self, tokens, targets):
        """Sum of the token losses of this rank's sequences, divided by the counted tokens
        of the whole micro-batch (``token_count``), so that the sum over batch blocks is the
        micro-batch's mean loss."""
        count = self.token_count(targets)
        rows = self.rows(tokens.shape[0])
        tokens, targets = tokens[rows], targets[rows]
        x = self.embed(tokens)
        for i in range(self.cfg.num_layers):
            probe = self.layer_probe(i) if self.layer_probe else None
            if probe is not None:
                probe.__enter__()
            x = self.block(i, x)
            if probe is not None:
                probe.__exit__(None, None, None)
        return self.head(x, targets) / count

    def token_count(self, targets: torch.Tensor) -> int:
        """The micro-batch's counted tokens (targets not ``IGNORE_INDEX``: ``loss_mask``),
        every batch block's: the cross-entropy's sum leaves the masked ones out, and a
        block's share of the mean is its sum over the whole micro-batch's count, not its
        own (Megatron-LM's ``--calculate-per-token-loss`` divides by the count all-reduced
        over the ranks that split the batch)."""
        return counted_tokens(targets)


def reduce_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in one coalesced all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
