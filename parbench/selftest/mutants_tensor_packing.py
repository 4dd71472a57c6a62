"""Packed sequences (``pack_docs``; issue 20, sec. 3) handled wrongly by the multi-dimensional
tensor-parallel schemes (2D / 2.5D SUMMA, 3D), whose ranks hold whole sequences of a batch
block and must find that block's documents in its tokens:

- the attention of a grid rank's heads plain causal over each sample (the positions restart
  at each EOD, but the grid layer never got the per-document mask: a token attends to the
  previous documents of its sample);
- the 3D position embedding indexed by the position in the sample (--reset-attention-mask
  without --reset-position-ids);
- the 3D attention masked with the documents of the residual stream's rows (layout L1's
  batch block i q + j) instead of the rows its QKV output holds (layout L2's i q + l: the
  QKV linear's reduce-scatter over z moves tokens between ranks) -- right on the ranks where
  j = l, wrong on the others.

Each is real code in the scheme's model; the documents are drawn so that every step has
samples of several documents (``PACKED``)."""
from __future__ import annotations

from impls.tensor.cube import Cube3D, CubeGPT
from impls.tensor.summa import Optimus, SummaGPT, Tesseract

from .catalogue import mutant, with_model

#: 1..3 documents per sample over 2 micro-batches
PACKED = {"pack_docs": "3", "num_microbatches": "2"}
#: the smallest cube: tp = 2^3, 8 heads, batch blocks of one sample
CUBE = {**PACKED, "tp": "8", "micro_batch_size": "4", "num_heads": "8", "hidden_size": "64",
        "ffn_hidden_size": "256"}



class _SummaCausalOnly(SummaGPT):
    def block(self, i, x, docs=None):
        return super().block(i, x, None)  # the bug: the documents never reach the attention


@mutant("2d-packed-attention-causal-only", base="tensor.2d", overrides={**PACKED, "tp": "4"},
        bug="positions restart at each EOD but the grid's attention is plain causal")
class SummaPackedCausalOnly(with_model(Optimus, _SummaCausalOnly)):
    pass


@mutant("2.5d-packed-attention-causal-only", base="tensor.2.5d",
        overrides={**PACKED, "tp": "4", "tp_depth": "4", "micro_batch_size": "4"},
        bug="Tesseract's depth layers attend plain causally across the packed documents")
class TesseractPackedCausalOnly(with_model(Tesseract, _SummaCausalOnly)):
    pass


class _CubeSamplePositions(CubeGPT):
    def embed(self, tokens, docs=None):
        return super().embed(tokens, None)  # the bug: positions counted from the sample's start


@mutant("3d-packed-positions-not-reset", base="tensor.3d", overrides=CUBE,
        bug="3D attends within documents but embeds positions counted from the sample's start")
class CubePackedPositionsNotReset(with_model(Cube3D, _CubeSamplePositions)):
    pass


class _CubeResidualRowsDocs(CubeGPT):
    def attention_rows(self, batch):
        return self.rows(batch)  # the bug: layout L1's rows, not those QKV's output holds


@mutant("3d-packed-docs-of-residual-rows", base="tensor.3d", overrides=CUBE,
        bug="3D masks its attention with the documents of its residual rows (layout L1), "
            "not of the rows its QKV output holds (layout L2)")
class CubePackedDocsOfResidualRows(with_model(Cube3D, _CubeResidualRowsDocs)):
    pass
