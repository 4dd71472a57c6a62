"""Realistic bugs in the token-slice pipelines (Seq1F1B, TeraPipe): each mutant swaps the
executor's slice forward (``impls.pipeline.segment_forward.SliceForward``) for one with one
thing wrong. They run on ``FAMILY_CASES["pipeline"]`` (tiny-4l, pp=2, m=4) with 2 token
slices per micro-batch; TeraPipe's with its DP slicing on a 32-token sequence, where the DP
cuts unevenly (17 + 15 tokens). The controls run the same cases on the correct schemes.

* ``seq1f1b-no-kv-cache``: a slice attends only within itself (the earlier slices' cached
  K/V are not passed to its attention) -- the forward differs, caught by the losses;
* ``seq1f1b-unscaled-slice-loss``: each slice's loss is its own token mean, not weighted by
  l_j / s -- the gradients are k times too large, caught by the gradient check;
* ``terapipe-detached-kv-cache``: the cache is kept detached, so the K/V gradients of the
  later slices never reach the earlier slices' backwards -- the losses agree, the gradients
  of every layer's QKV (and below) do not;
* ``terapipe-mask-off-by-one``: the causal mask of a slice is placed one position late, so
  every query also sees the next token -- caught by the losses.
"""
from __future__ import annotations

from impls.pipeline import SCHEMES
from impls.pipeline.segment_forward import SliceForward
from impls.pipeline.segments import SegmentExecutor

from .catalogue import mutant

SEQ1F1B = {"seq_segments": "2"}
TERAPIPE = {"seq_segments": "2", "terapipe_slicing": "dp", "seq_length": "32"}


def _executor(forward: type[SliceForward]) -> type[SegmentExecutor]:
    return type(f"Executor_{forward.__name__}", (SegmentExecutor,),
                {"slice_forward_class": forward})


class _NoCache(SliceForward):
    def visible_cache(self, cache):
        return []  # the bug: the earlier slices' K/V never reach this slice's attention


class _UnscaledLoss(SliceForward):
    def loss_weight(self, length, seq_length):
        return 1.0  # the bug: every slice's token mean counts as a whole sequence's


class _DetachedCache(SliceForward):
    def cache_leaf(self, t):
        return t.detach()  # the bug: no gradient flows back into the cached K/V


class _MaskOffByOne(SliceForward):
    mask_shift = 1  # the bug: query positions start one past the slice's offset


@mutant("seq1f1b-no-kv-cache", base="pipeline.seq1f1b", overrides=SEQ1F1B,
        bug="a slice attends only within itself: the earlier slices' cached K/V are not "
            "passed to its attention")
class Seq1F1BNoCache(SCHEMES["seq1f1b"]):
    executor_class = _executor(_NoCache)


@mutant("seq1f1b-unscaled-slice-loss", base="pipeline.seq1f1b", overrides=SEQ1F1B,
        bug="each slice's loss is its own token mean, not weighted by its share l_j/s of "
            "the sequence")
class Seq1F1BUnscaledLoss(SCHEMES["seq1f1b"]):
    executor_class = _executor(_UnscaledLoss)


@mutant("terapipe-detached-kv-cache", base="pipeline.terapipe", overrides=TERAPIPE,
        bug="the K/V cache is detached: later slices' K/V gradients are not accumulated into "
            "the earlier slices' backwards")
class TeraPipeDetachedCache(SCHEMES["terapipe"]):
    executor_class = _executor(_DetachedCache)


@mutant("terapipe-mask-off-by-one", base="pipeline.terapipe", overrides=TERAPIPE,
        bug="the causal mask of a slice starts one position late: every query also sees the "
            "next token")
class TeraPipeMaskOffByOne(SCHEMES["terapipe"]):
    executor_class = _executor(_MaskOffByOne)
