"""Closed forms of DistFlashAttn (Li et al. 2023, "DISTFLASHATTN: Distributed Memory-efficient
Attention for Long-context LLMs Training", arXiv 2310.03294): the balanced causal schedule's
work per worker (Sec. 3.1), its point-to-point traffic per worker (Sec. 3.1-3.2), and the
memory and forward count of rematerialization-aware checkpointing (Sec. 3.3).

Stated rules (P workers, contiguous chunks of n = s/P tokens, worker r 0-based;
T = P // 2 time steps after the diagonal one; helping runs for the first H = P - 1 - T of
them: T when P is odd, T - 1 when P is even):

- at step t worker r computes its queries against chunk r - t when t <= r, else -- for
  t <= H -- the queries of worker r + P - t against its own chunk (a helper), else idles;
- so worker r computes the diagonal block, min(r, T) of its own full blocks and
  max(0, H - r) helped blocks: (P + 1)/2 blocks each for odd P; P/2 and P/2 + 1 for the
  first and second half when P is even -- against r + 1 for the unbalanced causal ring.
  In time steps of one block the causal ring leaves (P - 1)/(2P) of the worker-steps idle
  (P steps, P(P+1)/2 blocks); the balanced schedule takes T + 1 steps, so it idles
  1 - (P+1)/(2(T+1)): 0 for odd P and 1/(P+2) for even P (the diagonal counted as a
  whole block step, as the schedule's figure draws it);
- forward messages of worker r per layer and micro-batch: its K and V (one message of
  2 b n h elements) to worker r + t for every step t <= T with r + t < P: min(T, P-1-r);
  its queries (b n h) to its helper at the steps it is helped: max(0, r - T) (= H + r + 1 -
  P, the chunks 0 .. r - T - 1 it does not compute itself); as a helper, max(0, H - r)
  partial results of b n h + b a n elements (output and one log-sum-exp per row and head);
- backward: K, V again min(T, P-1-r) times, the dK, dV of every block it computed for
  another worker's chunk back to that worker (2 b n h, min(r, T) times), the queries'
  bundle (q, dO, O: 3 b n h, and the log-sum-exp b a n) to its helper max(0, r - T) times,
  and as a helper the dQ (b n h) back, max(0, H - r) times;
- recompute ``full`` (rematerialization-aware, Sec. 3.3): nothing more -- the attention
  forward is not re-run; ``selective`` checkpoints the attention core at its inputs (the
  naive choice) and repeats the forward messages once. Over the workers the forward sends
  sum(min(T, P-1-r)) + sum(max(0, r-T)) K/V and Q messages.

Gradients (the family's rule, ``context.gradient_allreduce``) and model states
(``context.replica_states``) are those of every context-parallel scheme.
"""
from __future__ import annotations

from .comm import Transfer
from .context import gradient_allreduce, replica_states
from .prediction import RankPrediction
from .shape import Shape, require_positive_int


def schedule_steps(P: int) -> tuple[int, int]:
    """(T, H): time steps after the diagonal one, and the steps at which workers help."""
    require_positive_int("cp", P)
    T = P // 2
    return T, P - 1 - T


def blocks_per_worker(P: int) -> list[int]:
    """Block computations (diagonal included) of each worker in one attention forward."""
    T, H = schedule_steps(P)
    return [1 + min(r, T) + max(0, H - r) for r in range(P)]


def unbalanced_blocks(P: int) -> list[int]:
    """The causal ring on contiguous chunks: worker r computes r + 1 blocks."""
    return [r + 1 for r in range(P)]


def work_per_worker(s: int, P: int) -> list[int]:
    """Query-key pairs each worker's kernels evaluate per head and sample: the causal
    diagonal n(n+1)/2 plus n^2 per full block; sums to s(s+1)/2 over the workers."""
    require_positive_int("cp", P)
    if s % P:
        raise ValueError(f"cp={P} does not divide seq_length={s}")
    n = s // P
    return [n * (n + 1) // 2 + (k - 1) * n * n for k in blocks_per_worker(P)]


def idle_fraction(P: int, balanced: bool = True) -> float:
    """Idle worker-steps over all worker-steps, a diagonal counted as one block step."""
    work = P * (P + 1) // 2
    steps = (P // 2 + 1) if balanced else P
    return 1 - work / (P * steps)


def worker_transfers(b: int, s: int, h: int, a: int, P: int, r: int, layers: int = 1,
                     num_microbatches: int = 1, bytes_per_element: int = 4,
                     recompute: str = "none", axis: str = "cp") -> list[Transfer]:
    """Worker r's sends per step (module doc), per layer and micro-batch times L m."""
    if P == 1:
        return []
    if s % P:
        raise ValueError(f"cp={P} does not divide seq_length={s}")
    T, H = schedule_steps(P)
    e, n, k = bytes_per_element, s // P, layers * num_microbatches
    fwd = 2 if recompute == "selective" else 1
    kv_sends, q_sends = min(T, P - 1 - r), max(0, r - T)
    helped, own_blocks = max(0, H - r), min(r, T)
    rows = [("K, V (fwd)", 2 * b * n * h, kv_sends * fwd),
            ("queries to the helper (fwd)", b * n * h, q_sends * fwd),
            ("helper's output and log-sum-exp (fwd)", b * n * (h + a), helped * fwd),
            ("K, V (bwd)", 2 * b * n * h, kv_sends),
            ("dK, dV to their owner (bwd)", 2 * b * n * h, own_blocks),
            ("q, dO, O, log-sum-exp to the helper (bwd)", b * n * (3 * h + a), q_sends),
            ("helper's dQ (bwd)", b * n * h, helped)]
    return [Transfer(axis, "send", P, elems * e, count * k, what)
            for what, elems, count in rows if count]


def remat_layer_activation_bytes(s: int, b: int, h: int, a: int, cp: int,
                                 bytes_per_element: int = 4) -> int:
    """Bytes a rematerialization-aware checkpoint keeps per layer on one worker: the layer
    input and the attention output (b n h each) and the log-sum-exp (fp32, b a n)."""
    n = s // cp
    return 2 * b * n * h * bytes_per_element + b * a * n * 4


def rank_predictions(shape: Shape, *, cp: int, dp: int = 1, micro_batch_size: int,
                     num_microbatches: int = 1, recompute: str = "none",
                     optimizer: str = "adamw", elem_bytes: int = 4) -> list[RankPrediction]:
    """Every global rank's step (cp index = rank mod cp: Megatron order with tp = 1)."""
    states = replica_states(shape, optimizer, elem_bytes)
    grads = gradient_allreduce(shape, cp, dp, elem_bytes)
    out = []
    for rank in range(cp * dp):
        tr = worker_transfers(micro_batch_size, shape.s, shape.h, shape.a, cp, rank % cp,
                              shape.l, num_microbatches, elem_bytes, recompute)
        tr = [t for t in tr + grads if t.count]
        out.append(RankPrediction(tr, states, {"transfers": [t.as_dict() for t in tr]}))
    return out
