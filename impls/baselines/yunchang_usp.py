"""yunchang (the authors' implementation of USP: Fang & Zhao 2024, "USP: A Unified Sequence
Parallelism Approach for Long Context Generative AI", arXiv 2405.07719; PyPI ``yunchang``
0.6.4) as the attention of ``context.usp``'s cases.

Every layer's attention core is yunchang's ``LongContextAttention`` (Ulysses all-to-alls
``SeqAllToAll4D`` inside a group of ``cp_ulysses`` ranks, then yunchang's ring attention over
``cp / cp_ulysses`` ranks on the gathered tokens, causal): ``ring_impl_type="basic"`` for
contiguous shards (``cp_balance=none``), ``"zigzag"`` for ``cp_balance=zigzag`` (yunchang's
``zigzag_extract_local`` is ``layout.usp_positions``' zigzag layout). The rest of the step --
the reference model on the rank's tokens (``context.shard``), the gradient all-reduce over
dp x cp, the optimizer -- is ``context.usp``'s, so a difference from the golden run is
yunchang's attention.

Process groups: yunchang's ``set_seq_parallel_pg(u, r, rank, world, use_ulysses_low=True)``
makes, per block of u r consecutive world ranks, Ulysses groups of u consecutive ranks and
ring groups of stride u; it stores them in ``yunchang.globals.PROCESS_GROUP``, which
``LongContextAttention`` reads when built. Here the two are the mesh's ``cp_ulysses`` and
``cp_ring`` subgroups of ``context.usp`` (the same partition of each cp group: members
g[i u:(i+1) u] and g[j::u]), set in ``PROCESS_GROUP`` just before the attention is built, so
that the ledger attributes yunchang's traffic to those axes and no extra groups are made
(``tests/baselines/test_context_baselines.py`` checks that ``set_seq_parallel_pg`` would
build the same membership, ``USPScheme.grid_partition``, on dp x cp worlds).

CPU shim (``yunchang_kernels``), the only one: flash-attn's block kernel replaced by torch's
CPU flash-attention with flash-attn's contract; yunchang's own arithmetic is unchanged. yunchang
is the optional extra ``yunchang``; without it the scheme is unavailable, saying why.

Findings (``scripts/yunchang_cpu_check.py``, ``scripts/yunchang_fp32_repro.py``): stock
yunchang trains on no CPU kernel; with the shim its forward equals the golden run's but its
fp32 gradients do not -- the ring backward's ``buffer.to(torch.float32)`` aliases the block
buffer that the next block's kernel overwrites (flash-attn only takes fp16 / bf16, where it is
a copy), and the basic ring casts dq to bf16 -- so the rows are not equivalent. With the
two lines patched in a copy of yunchang (``.to(torch.float32, copy=True)``, ``dq.to(q.dtype)``)
the three suite rows pass against the golden run; the bf16 cast alone stays under the
fp32 verdict's atol on the tiny models' gradients (the aliasing does not). A ring of one
(``cp_ulysses = cp``) sends dK, dV to itself, which gloo refuses: refused on cpu. Traffic:
the Ulysses all-to-alls are ``context.usp``'s closed form exactly; the ring sends K and V as
two messages each, and each dK, dV accumulator starts at its owner and makes r hops back to
it (the closed form: r - 1 hops from the owner's neighbour), so the ring's bytes exceed the
closed form by one dK, dV block per layer and micro-batch.
"""
from __future__ import annotations

import importlib

from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.scheme import register

from impls.context.schemes import USPScheme

#: the yunchang release this adapter follows
YUNCHANG_VERSION = "0.6.4"
#: cp_balance -> yunchang's ring implementation with that layout
RING_IMPL = {"none": "basic", "zigzag": "zigzag"}


def yunchang_missing() -> str | None:
    """Why yunchang cannot be imported here, else None."""
    try:
        importlib.import_module("yunchang")
    except ImportError as e:
        return (f"yunchang=={YUNCHANG_VERSION} is not importable ({e}); install the "
                "'yunchang' extra")
    return None


class YunchangCore:
    """q (b, n, heads, d), k, v (b, n, kv heads, d) -> (b, n, h) through
    ``LongContextAttention`` (causal, scale 1/sqrt(d): its default)."""

    docs = None  # never packed (the scheme refuses pack_docs)

    def __init__(self, attn):
        self.attn = attn

    def __call__(self, q, k, v):
        b, n, heads, d = q.shape
        return self.attn(q, k, v, causal=True).reshape(b, n, heads * d)


def long_context_attention(ulysses, ring, ring_impl: str):
    """yunchang's ``LongContextAttention`` on the given groups (``PROCESS_GROUP`` is what its
    constructor reads; set here, then restored)."""
    from yunchang import LongContextAttention
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType

    from impls.baselines.yunchang_kernels import install_cpu_flash_kernels
    install_cpu_flash_kernels()
    before = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = ulysses, ring
    try:
        return LongContextAttention(ring_impl_type=ring_impl, attn_type=AttnType.FA)
    finally:
        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = before


@register
class YunchangUSP(USPScheme):
    name = "baseline.yunchang.usp"
    baseline_of = "context.usp"
    known_finding = ("yunchang 0.6.4's ring backward aliases its fp32 dq / dk / dv "
                     "accumulators with the block buffers the next kernel overwrites (fp32 "
                     "gradients off; bf16 / fp16 copy): scripts/yunchang_fp32_repro.py")
    options = ("cp_balance", "cp_ulysses")
    description = "yunchang 0.6.4 LongContextAttention (USP: Ulysses x ring), CPU block kernel"
    #: the shared forward: RoPE, GQA (K/V all-to-all at their own heads), SwiGLU, RMSNorm
    model_features = MODEL_FEATURES - {"mla"}

    @classmethod
    def unavailable(cls) -> str | None:
        return yunchang_missing()

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        balance = case.options.context.cp_balance
        if balance not in RING_IMPL:
            raise ConfigError(f"cp_balance={balance!r}: {cls.name} runs "
                              f"{' or '.join(RING_IMPL)} (yunchang's basic and zigzag rings)")
        if cls.ring_size(case) == 1 and case.run.device == "cpu":
            raise ConfigError(f"cp_ulysses={case.options.context.cp_ulysses} with cp="
                              f"{case.layout.cp}: on cpu {cls.name} needs a ring of at least "
                              "2 ranks (yunchang's ring backward sends dK, dV to the rank "
                              "itself, which gloo refuses: scripts/yunchang_fp32_repro.py)")
        if case.options.recompute != "none":
            raise ConfigError(f"recompute={case.options.recompute!r}: {cls.name} runs "
                              "recompute=none")
        missing = yunchang_missing()
        if missing:
            raise ConfigError(f"scheme={cls.name}: {missing}")

    def build_core(self):
        uly, ring = self.grid_groups()
        impl = RING_IMPL[self.balance(self.ctx.case)]
        return YunchangCore(long_context_attention(uly, ring, impl))

    def metrics(self):
        return {}
