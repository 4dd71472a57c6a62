"""The 2D / 2.5D / 3D grids on the LLaMA blocks (``llama-tiny``), built wrongly:

- SwiGLU's fc1 [gate; up] split into q contiguous row blocks like a plain linear, so grid
  column 0 holds the whole gate and column 1 the whole up projection and each computes
  silu(first half) * second half of its own block (its output block j must be
  [gate_j; up_j], the same f/q columns of each half);
- RMSNorm over a hidden dimension split across the hidden group, each rank normalising its
  block by the mean square of its own block only (the per-token sum of squares not
  all-reduced over ``tp_z``);
- grouped-query attention's K/V heads of the wrong grid column: column j holds its query
  heads beside the K/V heads of column j + 1 (mod q), the off-by-one between the column and
  the query group it serves.

The first and the third move exactly the bytes of the right scheme (only the numbers are
wrong); the second also drops the norms' all-reduces.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from impls.tensor.cube import Cube3D, CubeGPT
from impls.tensor.shards import Placement, blocks
from impls.tensor.summa import Optimus, SummaGPT, Tesseract
from parbench.model.blocks import NORM_EPS

from .catalogue import mutant, with_model

LLAMA_2D = {"model": "llama-tiny", "tp": "4", "num_microbatches": "2"}
#: tp = 8 grids (q = 2): 8 query heads over the preset's 2 K/V heads
LLAMA_8 = {"model": "llama-tiny", "tp": "8", "micro_batch_size": "4", "num_heads": "8",
           "hidden_size": "64", "num_microbatches": "2"}


def _rows_replaced(model, pl: Placement, rows_of) -> Placement:
    """Placement ``pl`` of a linear's weight or bias with its output rows replaced by
    ``rows_of(grid column j)``."""
    def index(t):
        return (rows_of(model.coords(t)[2]),) + tuple(pl.index(t)[1:])
    return Placement(pl.full_name, pl.full_shape, index)


class _Fc1Contiguous(SummaGPT):
    def placement(self, name, shape):
        right = super().placement(name, shape)
        if ".mlp.fc1." not in name:
            return right
        w = shape[0] // self.q
        # the bug: a contiguous 1/q of [gate; up], not [gate_j; up_j]
        return _rows_replaced(self, right, lambda j: blocks(j * w, w))


@mutant("2d-swiglu-fc1-contiguous", base="tensor.2d", overrides=LLAMA_2D,
        bug="SwiGLU's fc1 [gate; up] split into contiguous column blocks on the grid "
            "(column 0 all gate, column 1 all up)")
class SummaSwiGLUContiguous(with_model(Optimus, _Fc1Contiguous)):
    pass


class _LocalRMSNorm(CubeGPT):
    def layer_norm(self, x, prefix, group=None):
        # the bug: the mean square of this rank's hidden block only (no all-reduce)
        return F.rms_norm(x, (x.shape[-1],), self.p(f"{prefix}.weight"), eps=NORM_EPS)


@mutant("3d-rmsnorm-local-sum", base="tensor.3d", overrides=LLAMA_8,
        bug="3D RMSNorm normalises each hidden block by its own sum of squares (not "
            "all-reduced over the hidden group)")
class CubeLocalRMSNorm(with_model(Cube3D, _LocalRMSNorm)):
    pass


class _NextColumnKV(SummaGPT):
    def placement(self, name, shape):
        right = super().placement(name, shape)
        if ".attn.qkv." not in name:
            return right
        nq = self.heads * self.cfg.head_dim

        def rows(j):
            mine = right.index(j)[0]  # column j's rows (tp index j: grid row 0, depth 0)
            other = right.index((j + 1) % self.q)[0]
            return torch.cat([mine[:nq], other[nq:]])  # the bug: K/V of column j + 1
        return _rows_replaced(self, right, rows)


@mutant("2.5d-gqa-kv-heads-next-column", base="tensor.2.5d",
        overrides={**LLAMA_8, "tp_depth": "2"},
        bug="GQA on the grid: column j's query heads with the K/V heads of column j+1")
class TesseractGQANextColumn(with_model(Tesseract, _NextColumnKV)):
    pass
