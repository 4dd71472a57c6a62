"""Megatron 1D tensor parallelism (Shoeybi et al. 2019) and its sequence-parallel form
(Korthikanti et al. 2022) on the reference GPT.

One tp rank holds (t = tp, r = its index in the tp group):

- the token embedding's rows ``[r V'/t, (r+1) V'/t)`` of the vocabulary padded to V', a
  multiple of t (Megatron's ``--make-vocab-size-divisible-by``, here 1 x t; padding rows are
  zeros, never looked up, and their logits are masked to -inf so that the loss and the
  gradients are those of the unpadded vocabulary); the position embedding whole;
- per layer: the QKV projection split by heads (column-parallel: the Q rows of query heads
  ``[r a/t, (r+1) a/t)`` and, with grouped-query attention, the K and V rows of K/V heads
  ``[r g/t, (r+1) g/t)`` -- Megatron-Core splits the query groups over tp; with t > g =
  num_kv_heads a 1/t of Megatron-Core's group-interleaved rows, the output all-gathered and
  the rank's query heads and their group's K/V head taken from it: :mod:`.gqa`), the
  attention projection split by input features (row-parallel, bias
  whole), fc1 column- and fc2 row-parallel (SwiGLU: the gate rows ``[r f/t, (r+1) f/t)``
  and the up rows ``[f + r f/t, f + (r+1) f/t)``, as Megatron-Core's fused linear_fc1 shards
  [gate; up] per rank), both norms whole (LayerNorm or RMSNorm);
- the final LayerNorm whole and the LM head split by vocabulary rows (the token embedding
  itself when tied).

Without sequence parallelism the LayerNorms, row-parallel biases and position embedding see
identical inputs and gradients on every tp rank, so their gradients agree without any
communication (each rank reports its own copy, and the verdict compares every rank's). With
sequence parallelism (``sp``) the LayerNorm regions hold a sequence shard
``[s/t, b, h]``; those parameters' gradients are partial sums and are all-reduced over tp once
per step in one coalesced buffer, as Megatron does for ``sequence_parallel`` parameters.
The embedding's partial lookups are reduce-scattered along the sequence and each rank adds
its shard of the position embedding (so the position embedding joins that all-reduce).

Packed sequences (``pack_docs``; Megatron's --reset-position-ids / --reset-attention-mask):
every rank holds whole samples, finds their documents in the tokens, attends within them
(the mask also in the recomputed core) and embeds / rotates at the within-document positions
(under sp the rank's rows of them). RoPE (Su et al. 2021) rotates the rank's q / k heads.

``recompute``: ``selective`` recomputes the attention core (softmax(QK^T)V) in backward,
``full`` each transformer layer from its input (Korthikanti et al. Sec. 5).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parbench.model import IGNORE_INDEX, GPTStage
from parbench.model.blocks import NORM_EPS, mlp_activation, rotate
from parbench.model.mla import latent_attention
from parbench.model.packing import documents_of, self_mask

from . import gqa
from .collectives import ReduceFromRegion, ReduceScatterToSequence
from .megatron_mla import UP_PROJECTIONS, copy_to_heads, mla_attention, mla_rows
from .layers import (ColumnParallelLinear, Recompute, RowParallelLinear,
                     VocabParallelCrossEntropy, vocab_parallel_embedding)
from .shards import Placement, blocks, take
from .taps import Tapped, reference_parts


def padded_vocab(vocab: int, tp: int) -> int:
    """V' = the smallest multiple of tp not below V (make-vocab-size-divisible-by = 1)."""
    return -(-vocab // tp) * tp


class MegatronLayout:
    """Which full indices rank ``r`` of ``t`` holds, parameter by parameter."""

    def __init__(self, cfg, tp: int):
        self.cfg, self.tp = cfg, tp
        self.vp = padded_vocab(cfg.vocab_size, tp)

    def qkv_rows(self, r: int) -> torch.Tensor:
        """Rank r's rows of [Q (a heads); K (g heads); V (g heads)] x d: its query heads
        and its own query groups' K/V heads (Megatron-Core's num_query_groups / tp); with
        t > g a 1/t of Megatron-Core's group-interleaved rows (``gqa.qkv_rows``)."""
        cfg, t = self.cfg, self.tp
        d, a = cfg.head_dim, cfg.num_heads
        g = cfg.num_kv_heads or a
        if g < t:
            return gqa.qkv_rows(cfg, t, r)
        q, kv = a * d // t, g * d // t
        return torch.cat([blocks(r * q, q), blocks(a * d + r * kv, kv),
                          blocks((a + g) * d + r * kv, kv)])

    def fc1_rows(self, r: int) -> torch.Tensor:
        """Rank r's rows of fc1: a contiguous 1/t, or under SwiGLU its gate rows and its up
        rows (the same columns of f in each half of [gate; up])."""
        f, t = self.cfg.ffn, self.tp
        w = f // t
        if self.cfg.mlp != "swiglu":
            return blocks(r * w, w)
        return torch.cat([blocks(r * w, w), blocks(f + r * w, w)])

    def placement(self, name: str, shape: tuple) -> Placement:
        """The placement of full parameter ``name`` (of shape ``shape``)."""
        cfg, t = self.cfg, self.tp
        f = cfg.ffn
        rows_v = self.vp // t
        leaf = name.split(".")[-2:]
        kind = ".".join(leaf)
        if name in ("embed.tok.weight", "head.out.weight"):
            return Placement(name, shape, lambda r: (blocks(r * rows_v, rows_v), None))
        if kind in ("qkv.weight", "qkv.bias"):
            return Placement(name, shape, lambda r: (self.qkv_rows(r),) + (None,) *
                             (len(shape) - 1))
        if kind in ("fc1.weight", "fc1.bias"):
            return Placement(name, shape, lambda r: (self.fc1_rows(r),) + (None,) *
                             (len(shape) - 1))
        if kind in UP_PROJECTIONS:  # multi-head latent attention's, by heads
            return Placement(name, shape, mla_rows(shape, t))
        if kind == "proj.weight":  # input features: h, or a d_v under MLA
            w = shape[1] // t
            return Placement(name, shape, lambda r: (None, blocks(r * w, w)))
        if kind == "fc2.weight":
            return Placement(name, shape, lambda r: (None, blocks(r * f // t, f // t)))
        return Placement(name, shape)  # LayerNorms, row-parallel biases, positions


class MegatronGPT(Tapped, nn.Module):
    """This rank's shard of the reference GPT, computing in ``[s, b, h]``. Parameters carry
    the full model's names (``named_parameters`` lists the local shards).

    ``stage`` = (lo, hi, first, last) keeps layers [lo, hi) and the embedding / head when
    first / last (a pipeline stage; default: the whole model). ``forward`` takes tokens
    (first) or hidden states and returns the loss (last) or hidden states. Subclasses may
    override ``attention_core``, ``mlp``, ``positions`` and ``keep`` (which parameters this
    rank holds at all). The reference modules it computes run through ``tap`` (``taps``:
    probe points when a failure is localised)."""

    layout_cls = MegatronLayout

    def __init__(self, cfg, seed: int, group, tp: int, rank: int, sp: bool = False,
                 recompute: str = "none", stage: tuple | None = None):
        super().__init__()
        self.cfg, self.group, self.tp, self.rank = cfg, group, tp, rank
        self.sp, self.recompute = sp and tp > 1, recompute
        self.layout = self.layout_cls(cfg, tp)
        self.heads = cfg.num_heads // tp
        g = cfg.num_kv_heads or cfg.num_heads
        self.kv_heads = max(g // tp, 1)
        #: t > g: the QKV output is gathered and the rank's group taken (``gqa``)
        self.gathers_qkv = g < tp
        self.vocab_start = rank * (self.layout.vp // tp)
        self.lo, self.hi, self.first, self.last = stage or (0, cfg.num_layers, True, True)
        full = GPTStage(cfg, self.lo, self.hi, self.first, self.last, seed)
        self.placements: dict[str, Placement] = {}
        self.tied = cfg.tie_embeddings
        self._params = nn.ParameterDict()
        for name, p in full.named_parameters():
            if not self.keep(name):
                continue
            pl = self.layout.placement(name, tuple(p.shape))
            self.placements[name] = pl
            local = p.detach().clone() if pl.replicated else take(p.detach(), pl.index(rank))
            self._params[name.replace(".", "__")] = nn.Parameter(local)
        del full
        #: hook for SavedActivations around each layer's forward (step 0 only)
        self.layer_probe = None

    # ---- parameters --------------------------------------------------------------------
    def keep(self, name: str) -> bool:
        """Does this rank hold (a shard of) parameter ``name``?"""
        return True

    def p(self, name: str) -> nn.Parameter:
        return self._params[name.replace(".", "__")]

    def shards(self) -> dict[str, tuple[torch.Tensor, Placement]]:
        """full name -> (local parameter, placement)."""
        return {n: (self.p(n), pl) for n, pl in self.placements.items()}

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients are partial under sequence parallelism (replicated
        ones: LayerNorms, row-parallel biases, position embedding)."""
        return [self.p(n) for n, pl in self.placements.items() if pl.replicated]

    # ---- forward -----------------------------------------------------------------------
    def bias(self, name: str):
        """Parameter ``name`` or None when the model has no such bias (``bias=false``)."""
        key = name.replace(".", "__")
        return self._params[key] if key in self._params else None

    def embed(self, tokens: torch.Tensor, docs=None) -> torch.Tensor:
        """tokens [b, s] -> hidden [s, b, h] (sp: this rank's sequence shard); with packed
        ``docs`` the learned positions are the within-document ones (this rank's rows)."""
        tok = tokens.t()
        x = vocab_parallel_embedding(tok, self.p("embed.tok.weight"), self.vocab_start)
        s = tok.shape[0]
        if self.sp:
            x = ReduceScatterToSequence.apply(x, self.group, self.tp)
            lo = self.rank * (s // self.tp)
            rows = slice(lo, lo + s // self.tp)
        else:
            x = self.reduce(x)
            rows = slice(0, s)
        if self.cfg.position_embeddings:
            pos = self.positions(s) if docs is None else docs.pos.t()  # [s] or [s, b]
            emb = self.p("embed.pos.weight")[pos[rows]]
            x = x + (emb.unsqueeze(1) if docs is None else emb)
        return x

    def positions(self, s: int) -> torch.Tensor:
        """Global positions of the ``s`` tokens this rank embeds (all, in order)."""
        return torch.arange(s)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``g`` after the embedding's partial lookups: all-reduce forward."""
        return ReduceFromRegion.apply(x, self.group)

    def column(self, x, weight, bias):
        return ColumnParallelLinear.apply(x, weight, bias, self.group,
                                          self.tp if self.sp else 1)

    def row(self, x, weight, bias):
        y = RowParallelLinear.apply(x, weight, self.group, self.tp if self.sp else 1)
        return y if bias is None else y + bias

    def layer_norm(self, x, prefix: str):
        """The block's norm (replicated): LayerNorm, or RMSNorm (a weight only)."""
        shape, w = (self.cfg.hidden_size,), self.p(f"{prefix}.weight")
        if self.cfg.norm == "rmsnorm":
            return F.rms_norm(x, shape, w, eps=NORM_EPS)
        return F.layer_norm(x, shape, w, self.p(f"{prefix}.bias"), eps=NORM_EPS)

    def local_heads(self, qkv: torch.Tensor, docs=None):
        """q, k, v [b, heads, s, d] of this rank's heads from its qkv [s, b, (a + 2g) d / t]:
        RoPE at the (within-document) positions, K/V heads repeated over their query group
        (the rank's groups are whole: t divides g)."""
        s, b, _ = qkv.shape
        d = self.cfg.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = (t.reshape(s, b, -1, d).permute(1, 2, 0, 3) for t in (q, k, v))
        theta = self.cfg.rope_theta
        if theta:
            pos = torch.arange(s, device=qkv.device) if docs is None else docs.pos
            q, k = rotate(q, pos, theta), rotate(k, pos, theta)
        if self.kv_heads != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        return q, k, v

    def attention_core(self, qkv: torch.Tensor, docs=None) -> torch.Tensor:
        """softmax(QK^T/sqrt(d))V of this rank's heads: [s, b, (a + 2g) d/t] -> [s, b, h/t];
        causal, and within documents when packed (``docs``)."""
        s, b, _ = qkv.shape
        q, k, v = self.local_heads(qkv, docs)
        mask = None if docs is None else self_mask(docs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return y.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.cfg.head_dim)

    def attend(self, qkv: torch.Tensor, docs=None) -> torch.Tensor:
        """The attention core, recomputed in backward under selective recompute (with the
        same documents: the closure keeps them)."""
        fn = self.attention_core if docs is None else \
            (lambda y: self.attention_core(y, docs))
        return Recompute.apply(fn, qkv) if self.recompute == "selective" else fn(qkv)

    def block(self, i: int, x: torch.Tensor, docs=None) -> torch.Tensor:
        pre = f"blocks.{i}"
        a = self.tap(f"{pre}.ln1", self.layer_norm, x, f"{pre}.ln1")
        x = x + self.tap(f"{pre}.attn", self.attention, a, i, docs)
        u = self.tap(f"{pre}.ln2", self.layer_norm, x, f"{pre}.ln2")
        return x + self.tap(f"{pre}.mlp", lambda y: self.mlp(i, y), u)

    def attention(self, x: torch.Tensor, i: int, docs=None) -> torch.Tensor:
        """Layer ``i``'s attention on its normalised input: QKV column-parallel, the core of
        the rank's heads, the projection row-parallel (reduced: whole, or under sp the
        rank's sequence shard) plus its bias; multi-head latent attention: ``megatron_mla``."""
        if self.cfg.kv_lora_rank:
            return mla_attention(self, x, i, docs)
        pre = f"blocks.{i}.attn"
        qkv = self.column(x, self.p(f"{pre}.qkv.weight"), self.bias(f"{pre}.qkv.bias"))
        if self.gathers_qkv:
            qkv = self.query_group(qkv)
        return self.row(self.attend(qkv, docs), self.p(f"{pre}.proj.weight"),
                        self.bias(f"{pre}.proj.bias"))

    def query_group(self, qkv: torch.Tensor) -> torch.Tensor:
        """t > g: the rank's [q; k; v] columns from the all-gathered QKV output (its a/t
        query heads and their group's K/V head; Megatron-Core's ``get_query_key_value_
        tensors``, :mod:`.gqa`)."""
        full = gqa.gather_qkv(qkv, self.group, self.tp)
        return gqa.local_qkv(full, self.cfg, self.tp, self.rank)

    def copy_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """MLA's ``f`` on the up projections' inputs (``megatron_mla``); under sp the
        all-gather of their sequence shards (reduce-scatter backward)."""
        return copy_to_heads(x, self.group, self.tp if self.sp else 1)

    def latent_core(self, q, k, v, dims, mask=None) -> torch.Tensor:
        """MLA's core on the rank's heads: softmax(q k^T / sqrt(d + d_R)) v."""
        return latent_attention(q, k, v, dims, mask)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP: fc1 column-, fc2 row-parallel; SwiGLU (Shazeer 2020, Eq. 6)
        on the rank's [gate_r; up_r] rows."""
        pre = f"blocks.{i}.mlp"
        u = self.column(x, self.p(f"{pre}.fc1.weight"), self.bias(f"{pre}.fc1.bias"))
        u = mlp_activation(u, self.cfg.mlp)
        return self.row(u, self.p(f"{pre}.fc2.weight"), self.bias(f"{pre}.fc2.bias"))

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of padded vocabulary rows -> -inf (they take no part in the softmax)."""
        valid = self.cfg.vocab_size - self.vocab_start
        if valid >= logits.shape[-1]:
            return logits
        pad = torch.arange(logits.shape[-1], device=logits.device) >= valid
        return logits.masked_fill(pad, float("-inf"))

    def head(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final LN, vocab-parallel LM head and cross-entropy: the mean token loss over the
        counted targets (``token_mean``)."""
        w = self.p("embed.tok.weight") if self.tied else self.p("head.out.weight")
        logits = self.column(self.layer_norm(x, "head.ln"), w, None)
        logits = self.mask_padding(logits)
        target = targets.t()
        loss = VocabParallelCrossEntropy.apply(logits, target, self.vocab_start, self.group)
        return self.token_mean(loss, target)

    @staticmethod
    def token_mean(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean of the per-token ``loss`` over the targets that are not ``IGNORE_INDEX``
        (a masked prompt: ``loss_mask``). The vocab-parallel cross-entropy has no
        ignore_index (a masked target lies in no rank's columns, so its loss is the log-sum
        of exponentials); as in Megatron-LM, the loss mask is applied to its per-token
        output: masked tokens add nothing, and the mean is over the counted ones."""
        keep = target != IGNORE_INDEX
        return loss.masked_fill(~keep, 0.0).sum() / keep.sum()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, docs=None) -> torch.Tensor:
        """``docs``: the packed documents of the micro-batch (a pipeline stage's, from
        ``impls.pipeline.executor``); found in ``tokens`` on the first stage when not given."""
        if docs is None and self.first:
            docs = documents_of(self.cfg, tokens)
        x = self.tap("embed", self.embed, tokens, docs) if self.first else tokens
        for i in range(self.lo, self.hi):
            probe = self.layer_probe(i) if self.layer_probe else None
            if probe is not None:
                probe.__enter__()
            if self.recompute == "full":
                x = Recompute.apply(lambda y, i=i: self.block(i, y, docs), x)
            else:
                x = self.block(i, x, docs)
            if probe is not None:
                probe.__exit__(None, None, None)
        return self.tap("head", self.head, x, targets) if self.last else x

    def probe_points(self) -> dict:
        """Install the taps of the reference modules this model computes (``taps``)."""
        return self.install_taps(reference_parts(self.lo, self.hi, self.first, self.last))
