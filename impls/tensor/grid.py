"""What the multi-dimensional tensor-parallel schemes (2D / 2.5D SUMMA, 3D) share.

Their activations are partitioned both ways (Xu et al. 2021, Sec. 3; Wang et al. 2021,
Sec. 3; Bian et al. 2021, Sec. 3): a rank holds whole sequences of one batch block (so the
causal attention of its heads is local) and one block of the hidden dimension. Around the
parallel linears the model is handled as the papers' layers handle it:

- LayerNorm over a hidden dimension split across the *hidden group* (the ranks holding the
  other hidden blocks of the same tokens): the mean and the variance are all-reduced over it
  (2 all-reduces of one fp32 value per token forward, their conjugates backward; Optimus'
  ``LayerNorm2D``); gamma and beta hold the rank's hidden block. RMSNorm (Zhang & Sennrich
  2019, Eq. 4: no mean, no bias) all-reduces the per-token sum of squares only (one
  all-reduce forward, its conjugate backward);
- the LLaMA blocks (Touvron et al. 2023): the linears without biases when ``bias=false``;
  SwiGLU (Shazeer 2020, Eq. 6) with fc1's output block j holding the gate rows and the up
  rows of the same f/q columns (``MegatronLayout.fc1_rows`` with the grid's q), so silu(gate)
  * up is local; grouped-query attention (Ainslie et al. 2023) with QKV's column block j
  holding query heads [j a/q, (j+1) a/q) and K/V heads [j g/q, (j+1) g/q) -- the K/V heads
  of exactly those query heads' groups, which needs q to divide g (checked by
  ``analytic.tensor_grid.check_grid_heads``); RoPE (Su et al. 2021) on the rank's q / k
  heads at positions 0..s-1 (a rank holds whole sequences, so local positions are global),
  within each document when packed;
- the token and position embeddings hold the rank's hidden block of every row (no
  vocabulary split, so no padding); a lookup is local;
- the LM head uses the same block of the (possibly tied) embedding: each rank's partial
  logits over the whole vocabulary are all-reduced over the hidden group (``g``), and the
  cross-entropy of the rank's tokens is computed locally (the hidden group computes it
  q times, identically), summed and divided by the micro-batch's counted tokens;
- packed sequences (``pack_docs``): the rank's rows are whole samples, so it finds their
  documents in its own tokens and masks the attention of its heads to them, the position
  embedding indexed by the position within each document (no communication added);
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
from parbench.model.blocks import NORM_EPS, mlp_activation, split_heads
from parbench.model.packing import documents_of, self_mask
from parbench.probes import ModuleProbe

from .taps import Tapped, reference_parts

from .collectives import AllReduceSum, ReduceFromRegion
from .megatron_model import MegatronLayout
from .shards import Placement, blocks, take


def make_subgroup(mesh, name: str, members_of) -> tuple[object, list[int]]:
    """This rank's group of the partition of every tp group into ``members_of(tp_ranks)``
    (lists of global ranks), created once per mesh as axis ``name`` (the ledger's axis).
    Returns (group, its ranks in group order)."""
    partition = [m for tp_ranks in mesh.layout.groups("tp") for m in members_of(tp_ranks)]
    pg = mesh.subgroup(name, partition)
    mine = next(sorted(m) for m in partition if mesh.rank in m)
    return pg, mine


def grid_out_rows(cfg, q: int, name: str, rows: int, j: int) -> torch.Tensor:
    """The full output rows of linear weight / bias ``name`` (``rows`` of them) in output
    block j of q: QKV's head-aligned block (query heads j a/q.., K/V heads j g/q..), fc1's
    [gate_j; up_j] under SwiGLU (``MegatronLayout`` with the grid's q as its t), else the
    contiguous 1/q."""
    layout = MegatronLayout(cfg, q)
    if ".attn.qkv." in name:
        return layout.qkv_rows(j)
    if ".mlp.fc1." in name:
        return layout.fc1_rows(j)
    return blocks(j * (rows // q), rows // q)


def grid_layer_norm(x: torch.Tensor, weight, bias, group, hidden: int,
                    eps: float = NORM_EPS) -> torch.Tensor:
    """LayerNorm of ``x`` whose last dimension is one block of ``hidden`` split over
    ``group`` (two all-reduces of per-token sums)."""
    mean = AllReduceSum.apply(x.sum(-1, keepdim=True), group) / hidden
    xc = x - mean
    var = AllReduceSum.apply((xc * xc).sum(-1, keepdim=True), group) / hidden
    return xc * torch.rsqrt(var + eps) * weight + bias


def grid_rms_norm(x: torch.Tensor, weight, group, hidden: int,
                  eps: float = NORM_EPS) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019, Eq. 4) of ``x`` whose last dimension is one block of
    ``hidden`` split over ``group``: x / sqrt(sum_all x^2 / hidden + eps) * weight, the
    per-token sum of squares all-reduced once (no mean)."""
    ms = AllReduceSum.apply((x * x).sum(-1, keepdim=True), group) / hidden
    return x * torch.rsqrt(ms + eps) * weight


def local_attention(qkv: torch.Tensor, cfg, heads: int, kv_heads: int,
                    docs=None) -> torch.Tensor:
    """Causal attention of local heads: [b, s, (heads + 2 kv_heads) hd] (Q, K, V blocks) ->
    [b, s, heads hd]; K/V heads shared by their query groups, RoPE at the positions of whole
    sequences (``split_heads``); within the documents of the rank's rows when packed
    (``docs``: Megatron's --reset-attention-mask / --reset-position-ids)."""
    b, s, _ = qkv.shape
    q, k, v = split_heads(qkv, heads, kv_heads, cfg.head_dim, cfg.rope_theta, docs)
    mask = None if docs is None else self_mask(docs)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return y.transpose(1, 2).reshape(b, s, heads * cfg.head_dim)


class GridGPT(Tapped, nn.Module):
    """Parameters of one grid rank, named as in the reference model. Subclasses give
    ``placement(name, shape)``, ``linear(x, name)``, ``rows`` (this rank's batch block:
    a slice of sequences), the hidden group and ``head_dim``/``heads``. The reference
    modules run through ``tap`` (probe points when a failure is localised: ``grid_probes``).
    A grid column holds ``heads`` = a/q query heads and ``kv_heads`` = g/q K/V heads."""

    hidden_group = None
    q: int = 1

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.q

    @property
    def kv_heads(self) -> int:
        return (self.cfg.num_kv_heads or self.cfg.num_heads) // self.q

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

    def attention_rows(self, batch: int) -> slice:
        """The micro-batch's rows whose attention this rank computes (those of its QKV
        output): its own rows, unless the linears move tokens between ranks (3D)."""
        return self.rows(batch)

    def linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        raise NotImplementedError

    def p(self, name: str) -> nn.Parameter:
        return self._params[name.replace(".", "__")]

    def bias(self, name: str):
        """Parameter ``name``, or None when the model has no such bias (``bias=false``)."""
        key = name.replace(".", "__")
        return self._params[key] if key in self._params else None

    def add_bias(self, y: torch.Tensor, name: str) -> torch.Tensor:
        b = self.bias(name)
        return y if b is None else y + b

    def shards(self):
        return {n: (self.p(n), pl) for n, pl in self.placements.items()}

    # ---- forward -----------------------------------------------------------------------
    def layer_norm(self, x, prefix: str, group=None):
        """The block's norm over the hidden group: LayerNorm, or RMSNorm (a weight only)."""
        group = group if group is not None else self.hidden_group
        if self.cfg.norm == "rmsnorm":
            return grid_rms_norm(x, self.p(f"{prefix}.weight"), group, self.cfg.hidden_size)
        return grid_layer_norm(x, self.p(f"{prefix}.weight"), self.p(f"{prefix}.bias"),
                               group, self.cfg.hidden_size)

    def embed(self, tokens, docs=None):
        """The rank's hidden block of the token and position embeddings of its rows; with
        packed ``docs`` (its rows') the positions within each document
        (--reset-position-ids)."""
        x = F.embedding(tokens, self.p("embed.tok.weight"))
        if self.cfg.position_embeddings:
            pos = self.p("embed.pos.weight")
            x = x + (pos[: tokens.shape[1]] if docs is None else pos[docs.pos])
        return x

    def block(self, i: int, x, docs=None):
        pre = f"blocks.{i}"
        a = self.tap(f"{pre}.ln1", self.layer_norm, x, f"{pre}.ln1")
        x = x + self.tap(f"{pre}.attn", self.attention, a, pre, docs)
        u = self.tap(f"{pre}.ln2", self.layer_norm, x, f"{pre}.ln2")
        return x + self.tap(f"{pre}.mlp", self.mlp, u, pre)

    def attention(self, x, pre: str, docs=None):
        """The attention of block ``pre`` on its normalised input (the rank's heads)."""
        qkv = self.linear(x, f"{pre}.attn.qkv")
        attn = local_attention(qkv, self.cfg, self.heads, self.kv_heads, docs)
        return self.linear(attn, f"{pre}.attn.proj")

    def mlp(self, x, pre: str):
        """GELU, or SwiGLU on the rank's [gate_j; up_j] block of fc1's output."""
        u = mlp_activation(self.linear(x, f"{pre}.mlp.fc1"), self.cfg.mlp)
        return self.linear(u, f"{pre}.mlp.fc2")

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
        micro-batch's mean loss. A packed model's documents are found in the rank's own
        rows (whole sequences: a sample's documents are its own): those of its embedding rows,
        and those of the rows its attention computes (``attention_rows``)."""
        count = self.token_count(targets)
        rows, cores = self.rows(tokens.shape[0]), self.attention_rows(tokens.shape[0])
        docs = documents_of(self.cfg, tokens[cores])
        tokens, targets = tokens[rows], targets[rows]
        x = self.tap("embed", self.embed, tokens, documents_of(self.cfg, tokens))
        for i in range(self.cfg.num_layers):
            probe = self.layer_probe(i) if self.layer_probe else None
            if probe is not None:
                probe.__enter__()
            x = self.block(i, x, docs)
            if probe is not None:
                probe.__exit__(None, None, None)
        return self.tap("head", self.head, x, targets) / count

    def token_count(self, targets: torch.Tensor) -> int:
        """The micro-batch's counted tokens (targets not ``IGNORE_INDEX``: ``loss_mask``),
        every batch block's: the cross-entropy's sum leaves the masked ones out, and a
        block's share of the mean is its sum over the whole micro-batch's count, not its
        own (Megatron-LM's ``--calculate-per-token-loss`` divides by the count all-reduced
        over the ranks that split the batch)."""
        return counted_tokens(targets)


def activation_features(cfg) -> dict:
    """The LLaMA blocks' keywords of ``analytic.tensor_grid``'s activation forms: K/V
    heads, RoPE, SwiGLU (the norm and the biases keep the same bytes) and packed
    documents."""
    return {"kv_heads": cfg.num_kv_heads, "rope": bool(cfg.rope_theta),
            "swiglu": cfg.mlp == "swiglu", "packed": bool(cfg.pack_docs)}


def grid_probes(model: GridGPT, layout) -> list[ModuleProbe]:
    """The reference modules as probe points of a grid rank's model (issue 20, sec. 5):
    each micro-batch's call computes the rank's batch block of it (``rows``) and its hidden
    block (the LayerNorms' placement: ``coords``' fastest coordinate); every probed output
    -- embedding, norms, the attention's and the MLP's linears -- and every probed input
    lies in that layout (3D: layout L1). A block's loss is its rows' share of the
    micro-batch's mean over 1/m, so the input gradients are the golden run's."""
    b, m = layout.micro_batch_size, layout.num_microbatches
    rows, w = model.rows(b), model.cfg.hidden_size // model.q
    j = model.coords(model.tp_index)[2]
    calls = [(slice(i * b + rows.start, i * b + rows.stop), slice(None),
              slice(j * w, (j + 1) * w)) for i in range(m)]
    taps = model.install_taps(reference_parts(0, model.cfg.num_layers, True, True))
    return [ModuleProbe(name, tap, list(calls)) for name, tap in taps.items()]


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
