"""The ZeRO unit layout against the closed-form unit rule, without ranks: padding, shards and
the paper's per-stage figures."""
from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from impls.zero.layout import build_layout
from impls.zero.prediction import paper_figures
from parbench.analytic import data_parallel, shape_from
from parbench.config import ModelConfig
from parbench.model import build_model

configs = st.builds(lambda h, L, v: ModelConfig(hidden_size=h, num_heads=2, num_layers=L,
                                                vocab_size=v, seq_length=8),
                    st.sampled_from([8, 16]), st.integers(1, 3), st.sampled_from([61, 64]))


@given(cfg=configs, d=st.integers(1, 5), bucket=st.sampled_from([1e-4, 0.002, 1.0]))
def test_units_cover_the_model_once_padded_to_multiples_of_d(cfg, d, bucket):
    model = build_model(cfg, 0)
    lay = build_layout(model, d, bucket, 4)
    names = [n for u in lay.units for n in u.names]
    assert names == [n for n, _ in model.named_parameters()]
    assert lay.psi == sum(p.numel() for p in model.parameters())
    for u in lay.units:
        assert u.padded % d == 0 and 0 <= u.padded - u.numel < d
        assert u.shard == -(-u.numel // d)
    assert lay.padded_total == d * lay.shard_total
    if bucket >= 1.0:  # one unit: the whole flat buffer, ceil(Psi / d) per rank
        assert len(lay.units) == 1 and lay.shard_total == -(-lay.psi // d)
    # the implementation follows the closed-form unit rule the predictions use
    assert [u.numel for u in lay.units] == data_parallel.zero_units(shape_from(cfg), d, bucket, 4)


@given(cfg=configs, d=st.integers(2, 5), m=st.integers(1, 3))
def test_stage3_is_one_and_a_half_times_stage1_per_microbatch(cfg, d, m):
    shape = shape_from(cfg)

    def total(stage):
        return sum(Fraction(t.total_wire_bytes) for t in
                   data_parallel.zero(shape, d, stage, 0.002, m).transfers)

    padded = data_parallel.zero(shape, d, 1, 0.002, m).figures["padded_params"]
    assert total(3) == Fraction(3 * m, 2) * total(1)
    assert total(1) == Fraction(2 * (d - 1), d) * padded * 4


def test_paper_figures_reproduce_zero_figure_1():
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, Nd = 64, K = 12 -> 120 GB, 31.4 GB,
    16.6 GB, 1.88 GB per device (GB = 1e9 bytes)."""
    want = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}
    for stage, w in want.items():
        got = paper_figures(int(7.5e9), 64, stage, 2, True)["model_state_bytes"]["mixed_adam"]
        assert abs(got["total"] - w) / w < 5e-3
