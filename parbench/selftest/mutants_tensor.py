"""Realistic bugs in the tensor-parallel family: each mutant is a subclass of a native scheme
whose model (a subclass of its model) has one thing changed, registered as a scheme of its
own (``mutant.<id>``; see ``mutants_data``). They run on ``FAMILY_CASES["tensor"]`` (tiny,
tp=2, an odd vocabulary) plus their own overrides."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from impls.tensor import layers
from impls.tensor.collectives import (CopyToRegion, ReduceFromRegion, all_gather_dim0,
                                      reduce_scatter_dim0)
from impls.tensor.cube import Cube3D, CubeGPT, CubeLinear
from impls.tensor.grid import reduce_grads
from impls.tensor.megatron import Megatron1D, MegatronSP
from impls.tensor.megatron_model import MegatronGPT, MegatronLayout
from impls.tensor.shards import blocks
from impls.tensor.summa import Optimus, SummaGPT, SummaLinear, Tesseract

from .catalogue import mutant, with_model
from .optimizers import make_buggy_optimizer



# ---- Megatron 1D ------------------------------------------------------------------------------

class _SwappedFG(MegatronGPT):
    def column(self, x, weight, bias):
        # g (all-reduce forward) where f (all-reduce backward) belongs
        return F.linear(ReduceFromRegion.apply(x, self.group), weight, bias)

    def row(self, x, weight, bias):
        # f where g belongs: the partial sums are never added in forward
        return CopyToRegion.apply(F.linear(x, weight), self.group) + bias


@mutant("tp-fg-swapped", base="tensor.megatron",
        bug="the conjugate operators f and g are swapped around the parallel linears")
class TPSwappedFG(with_model(Megatron1D, _SwappedFG)):
    pass


class _NoEmbeddingReduce(MegatronGPT):
    def reduce(self, x):
        return x  # each rank keeps only the rows of its vocabulary shard


@mutant("tp-embedding-no-allreduce", base="tensor.megatron",
        bug="the vocab-parallel embedding's partial lookups are not all-reduced")
class TPNoEmbeddingReduce(with_model(Megatron1D, _NoEmbeddingReduce)):
    pass


class _UnmaskedPadding(MegatronGPT):
    def mask_padding(self, logits):
        return logits  # the padded rows' logits (0) join the softmax


@mutant("tp-vocab-padding-unmasked", base="tensor.megatron",
        bug="the logits of the padded vocabulary rows are not masked")
class TPUnmaskedPadding(with_model(Megatron1D, _UnmaskedPadding)):
    pass


class _RowBiasEveryRank(MegatronGPT):
    def row(self, x, weight, bias):
        # the bias is added to each partial sum, so t copies of it are summed
        return ReduceFromRegion.apply(F.linear(x, weight, bias), self.group)


@mutant("tp-row-bias-every-rank", base="tensor.megatron",
        bug="the row-parallel linears' bias is added on every rank before the all-reduce")
class TPRowBiasEveryRank(with_model(Megatron1D, _RowBiasEveryRank)):
    pass


class _ContiguousQKVLayout(MegatronLayout):
    def qkv_rows(self, r):
        n = 3 * self.cfg.hidden_size // self.tp
        return blocks(r * n, n)  # a contiguous 1/t of the rows, not whole heads of Q, K, V


class _ContiguousQKVSplit(MegatronGPT):
    layout_cls = _ContiguousQKVLayout


@mutant("tp-wrong-head-split", base="tensor.megatron",
        bug="QKV split into contiguous row blocks instead of by heads")
class TPWrongHeadSplit(with_model(Megatron1D, _ContiguousQKVSplit)):
    pass


class _LocalMaxCE(layers.VocabParallelCrossEntropy):
    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()
        lmax = logits.max(dim=-1).values  # the bug: no all-reduce (MAX) of the max logit
        z = logits - lmax.unsqueeze(-1)
        vl = logits.shape[-1]
        outside = (target < start) | (target >= start + vl)
        idx = (target - start).masked_fill(outside, 0)
        pred = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(pred, group=group)
        ez = z.exp()
        sum_exp = ez.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - pred
        ez.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(ez, idx, outside)
        return loss


class _LocalMaxGPT(MegatronGPT):
    def head(self, x, targets):
        w = self.p("embed.tok.weight") if self.tied else self.p("head.out.weight")
        logits = self.mask_padding(self.column(self.layer_norm(x, "head.ln"), w, None))
        return _LocalMaxCE.apply(logits, targets.t(), self.vocab_start, self.group).mean()


@mutant("tp-ce-local-max", base="tensor.megatron",
        bug="vocab-parallel cross-entropy subtracts each rank's own max logit")
class TPLocalMaxCE(with_model(Megatron1D, _LocalMaxGPT)):
    pass


class _UntiedHeadCopy(MegatronGPT):
    def head(self, x, targets):
        # the head reads a detached copy of the tied embedding: its gradient is lost
        w = self.p("embed.tok.weight").detach()
        logits = self.mask_padding(self.column(self.layer_norm(x, "head.ln"), w, None))
        return layers.VocabParallelCrossEntropy.apply(logits, targets.t(), self.vocab_start,
                                                      self.group).mean()


@mutant("tp-tied-head-grad-lost", base="tensor.megatron",
        overrides={"tie_embeddings": "true"},
        bug="a tied LM head's gradient is not accumulated into the embedding")
class TPTiedHeadGradLost(with_model(Megatron1D, _UntiedHeadCopy)):
    pass


@mutant("tp-no-wd", base="tensor.megatron", bug="weight decay dropped on the tp shards")
class TPNoWeightDecay(Megatron1D):
    def make_optimizer(self, params):
        return make_buggy_optimizer(params, self.ctx.run, "no-wd")


# ---- Megatron sequence parallelism ---------------------------------------------------------------

class _AllReduceForReduceScatter(MegatronGPT):
    def row(self, x, weight, bias):
        # all-reduce the full sequence and keep this rank's shard (not a reduce-scatter)
        y = ReduceFromRegion.apply(F.linear(x, weight), self.group)
        n = y.shape[0] // self.tp
        return y[self.rank * n:(self.rank + 1) * n] + bias


@mutant("sp-allreduce-for-reducescatter", base="tensor.megatron-sp",
        bug="the row-parallel output is all-reduced and sliced instead of reduce-scattered")
class SPAllReduceForReduceScatter(with_model(MegatronSP, _AllReduceForReduceScatter)):
    pass


@mutant("sp-ln-grads-not-reduced", base="tensor.megatron-sp",
        bug="the sequence-parallel LayerNorm / bias gradients are not all-reduced over tp")
class SPLayerNormGradsNotReduced(MegatronSP):
    def after_backward(self):
        pass


# ---- 2D / 2.5D / 3D ---------------------------------------------------------------------------

class _SummaRootOffByOne(SummaLinear):
    @staticmethod
    def forward(ctx, x, weight, grid):
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        a = x.reshape(-1, x.shape[-1])
        b = weight.t()
        out = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        for l in range(grid.q):
            m = (l + 1) % grid.q  # the bug: W's round uses the next grid row as its root
            al = a.contiguous() if grid.j == l else torch.empty_like(a)
            dist.broadcast(al, src=grid.row_ranks[l], group=grid.row)
            bl = b.contiguous() if grid.i == m else torch.empty(b.shape, dtype=b.dtype)
            dist.broadcast(bl, src=grid.col_ranks[m], group=grid.col)
            out.addmm_(al, bl)
        return out.view(*x.shape[:-1], b.shape[1])


class _SummaWrongRoot(SummaGPT):
    def linear(self, x, prefix):
        return _SummaRootOffByOne.apply(x, self.p(f"{prefix}.weight"), self.grid) + \
            self.p(f"{prefix}.bias")


@mutant("2d-summa-root-off-by-one", base="tensor.2d", overrides={"tp": "4"},
        bug="SUMMA broadcasts the weight block of the wrong grid row in each round")
class SummaRootOffByOne(with_model(Optimus, _SummaWrongRoot)):
    pass


class _LocalLayerNormStats(SummaGPT):
    def layer_norm(self, x, prefix, group=None):
        # statistics of this rank's hidden block only (no all-reduce over the grid row)
        return F.layer_norm(x, (x.shape[-1],), self.p(f"{prefix}.weight"),
                            self.p(f"{prefix}.bias"))


@mutant("2d-layernorm-local-stats", base="tensor.2d", overrides={"tp": "4"},
        bug="the 2D LayerNorm normalises each hidden block by its own statistics")
class SummaLocalLayerNorm(with_model(Optimus, _LocalLayerNormStats)):
    pass


@mutant("2.5d-no-depth-reduce", base="tensor.2.5d",
        overrides={"tp": "4", "tp_depth": "4", "micro_batch_size": "4"},
        bug="the depth layers' weight gradients are not all-reduced (replicas diverge)")
class TesseractNoDepthReduce(Tesseract):
    def after_backward(self):
        weights = {id(w) for w in self.model.weights()}
        reduce_grads([p for p in self.params if id(p) not in weights], self.grid.col)


class _CubeGradNotReduced(CubeLinear):
    @staticmethod
    def backward(ctx, grad):
        xg, wg = ctx.saved_tensors
        in_group, w_group, out_group = ctx.groups
        q = ctx.q
        gg = all_gather_dim0(grad, out_group, q)
        grad_x = reduce_scatter_dim0(torch.matmul(gg, wg), in_group, q)
        gw = torch.matmul(gg.reshape(-1, gg.shape[-1]).t(), xg.reshape(-1, xg.shape[-1]))
        n = gw.shape[0] // q
        me = dist.get_rank(w_group)
        grad_w = gw[me * n:(me + 1) * n].clone()  # the bug: own rows, not summed over x
        return grad_x, grad_w, None, None, None, None


class _CubeNoWeightReduce(CubeGPT):
    def linear(self, x, prefix):
        g = self.grid
        groups = (g.y, g.x, g.z) if prefix.endswith(("attn.qkv", "mlp.fc1")) else \
            (g.z, g.x, g.y)
        return _CubeGradNotReduced.apply(x, self.p(f"{prefix}.weight"), *groups, self.q) + \
            self.p(f"{prefix}.bias")


@mutant("3d-weight-grad-not-reduced", base="tensor.3d",
        overrides={"tp": "8", "micro_batch_size": "4", "num_heads": "8", "hidden_size": "64",
                   "ffn_hidden_size": "256"},
        bug="3D keeps its own slice of the weight gradient instead of reduce-scattering it")
class CubeWeightGradNotReduced(with_model(Cube3D, _CubeNoWeightReduce)):
    pass

