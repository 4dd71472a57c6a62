"""BPipe in closed form: how many micro-batches each stage evicts, and the bytes that move.

Kim, Kim, Yu, Chun 2023, "BPipe: Memory-Balanced Pipeline Parallelism for Training Large
Language Models" (ICML 2023), Sec. 3. Under 1F1B (Narayanan et al. 2021, Sec. 2.2.1) stage s
of p holds min(p - s, m) micro-batches' activations at its peak. BPipe pairs stage x < p/2
with stage p-1-x; the evictor keeps at most T = ceil((p+2)/2) resident (counting the one its
current forward builds or backward needs) and, over T, evicts the latest micro-batch it holds
to its partner, loading it back before its backward.

**How many** (derived here from that rule, not read from the generator; the unit tests pin it
against ``parbench.schedules.bpipe.evicted_microbatches``). Stage x has warm-up w = p-1-x and
n = p - x in flight in the steady state; d = n - T micro-batches must be away at any time.
In the steady state of 1F1B a micro-batch kept from its forward to its backward spans the w
backwards in between, so of every w consecutive micro-batches T-1 fit and the latest d are
evicted (each stays away until just before its backward). Counting over m:

    E(x) = 0                                   if x >= p/2, d <= 0 or min(n, m) <= T
    E(x) = m - T                               if m <= w  (all forwards in the warm-up)
    E(x) = floor(m / w) d + max(0, (m mod w) - (w - d))   otherwise

**Bytes**: every eviction is one message of the micro-batch's saved activations on the
stage, and every load one message back; the evictor sends E(x) A(x) on axis ``bpipe_evict``
and the acceptor E(x) A(x) on ``bpipe_load``, one call each per micro-batch. A(x) for the
reference model (``saved_bytes_per_microbatch``) counts what autograd keeps in fp32 per layer,
per micro-batch of b sequences of s tokens (hidden h, MLP width f, a heads): the layer input,
the LN1 output, the QKV output, the attention output, the residual sum and the LN2 output
(8 b s h: the QKV output is 3), the fc1 output and the GeLU output (2 b s f), the two
LayerNorms' mean and 1/std (4 b s) and the fused attention's log-sum-exp (a b s) --
Korthikanti et al. 2022's Table 2 count without dropout, with the flash-style kernel and the
attention output shared by the projection (``activations.reference_layer_activation_bytes``
with ``proj_input_copy=False``, which adds the same terms). The first layer's input is the
embedding output on stage 0 and the received boundary elsewhere: b s h either way.
"""
from __future__ import annotations

from .activations import reference_layer_activation_bytes
from .shape import Shape, require_positive_int


def threshold(p: int) -> int:
    """T = ceil((p+2)/2): micro-batches' activations a BPipe stage keeps at most."""
    require_positive_int("p", p)
    return -(-(p + 2) // 2)


def evicted_count(p: int, m: int, stage: int) -> int:
    """E(x): micro-batches stage ``stage`` evicts in one step (module docstring)."""
    require_positive_int("m", m)
    if not 0 <= stage < p:
        raise ValueError(f"stage={stage} must be in [0, p={p})")
    t, n, w = threshold(p), p - stage, p - 1 - stage
    d = n - t
    if 2 * stage >= p - 1 or d <= 0 or min(n, m) <= t:
        return 0
    if m <= w:
        return m - t
    return (m // w) * d + max(0, m % w - (w - d))


def peak_resident(p: int, m: int, stage: int, bpipe: bool = True) -> int:
    """Micro-batches resident at a stage's peak: 1F1B min(p - s, m); BPipe at most T on
    every evictor (others as 1F1B; an acceptor's own plus the held ones are measured)."""
    own = min(p - stage, m)
    return min(own, threshold(p)) if bpipe and evicted_count(p, m, stage) else own


def saved_bytes_per_microbatch(shape: Shape, b: int, stages: int, stage: int) -> int:
    """A(x): bytes autograd saves for one micro-batch on a stage that is not the last:
    L/S layers of 4 (8 b s h + 2 b s f + (4 + a) b s) bytes (module docstring)."""
    require_positive_int("b", b)
    if stage >= stages - 1:
        raise ValueError(f"stage={stage}: the last stage (of {stages}) never evicts")
    if shape.num_layers % stages:
        raise ValueError(f"num_stages={stages} does not divide num_layers={shape.num_layers}")
    s, h, f, a = shape.s, shape.h, shape.f, shape.num_heads
    per_layer = 4 * (8 * b * s * h + 2 * b * s * f + (4 + a) * b * s)
    return shape.num_layers // stages * per_layer


def saved_bytes_check(shape: Shape, b: int) -> bool:
    """The count above equals Korthikanti's, as adapted in ``activations`` (fp32, no dropout,
    fused attention, projection input a view)."""
    return 4 * (8 * b * shape.s * shape.h + 2 * b * shape.s * shape.f
                + (4 + shape.num_heads) * b * shape.s) == reference_layer_activation_bytes(
        shape.s, b, shape.h, shape.num_heads, ffn_hidden=shape.f, bytes_per_element=4,
        proj_input_copy=False)


def pair_traffic(shape: Shape, p: int, m: int, rank: int, b: int) -> dict[str, tuple[int, int]]:
    """{axis: (wire bytes, send calls)} of a rank's BPipe transfers in one step."""
    if 2 * rank < p - 1:
        e = evicted_count(p, m, rank)
        return {"bpipe_evict": (e * saved_bytes_per_microbatch(shape, b, p, rank), e)} \
            if e else {}
    x = p - 1 - rank
    if x == rank:
        return {}
    e = evicted_count(p, m, x)
    return {"bpipe_load": (e * saved_bytes_per_microbatch(shape, b, p, x), e)} if e else {}
