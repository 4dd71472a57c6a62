"""DeepSpeed issue 4217, settled by measurement: per-rank bytes of one layer's forward for
DeepSpeed-Ulysses (``context.ulysses``, degree P over cp) and Megatron-SP
(``tensor.megatron-sp``, degree P over tp) on the same b x s x h activations.

    python scripts/issue_4217.py [degrees=2,4] [hidden_size=64] [seq_length=64] [key=value ...]

Each scheme runs (equivalent to the golden run, bytes checked against its closed form) with 1
and with 2 layers; the difference of the two steps' ledgers on the scheme's own axis is one
layer's traffic in a training step (forward and backward), free of the embedding /
vocabulary / data-parallel terms. Beside it, the forward closed forms: Ulysses'
4 (P-1)/P^2 bsh e and Megatron-SP's 4 (P-1)/P bsh e (``analytic.context.
ulysses_vs_megatron_sp``) and the paper's per-link figures 4Nh/P and 4Nh. Ulysses' backward
mirrors its forward (4 all-to-alls); Megatron-SP's backward also re-gathers the
column-parallel inputs for the weight gradients and all-reduces the sequence-parallel
LayerNorm and bias gradients, as Megatron-Core does, so its step is more than twice its
forward. No assertions: tests/equivalence/test_context.py asserts the same figures.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.analytic.context import ulysses_vs_megatron_sp  # noqa: E402
from parbench.config import CaseConfig  # noqa: E402
from parbench.overrides import apply_overrides, parse_overrides  # noqa: E402
from parbench.runner import PoolCache, case_row  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402

DEFAULTS = {"hidden_size": "64", "num_heads": "4", "seq_length": "64", "vocab_size": "128",
            "micro_batch_size": "1", "num_microbatches": "1", "steps": "1",
            "timed_steps": "0"}
SCHEMES = {"ulysses": ("context.ulysses", "cp"), "megatron-sp": ("tensor.megatron-sp", "tp")}


def per_layer_fwd_bytes(pools, base: dict, scheme: str, axis: str, p: int) -> tuple[float, bool]:
    """(one layer's bytes on ``axis`` in a training step, every run passed)."""
    wire, ok = {}, True
    for layers in (1, 2):
        case = apply_overrides(CaseConfig(), {**base, "scheme": scheme, axis: str(p),
                                              "num_layers": str(layers)})
        row = case_row(case, pools.get(case))
        ok = ok and row.passed
        wire[layers] = row.traffic.wire_max().get(axis, 0.0)
    return wire[2] - wire[1], ok


def main(argv: list[str]) -> None:
    ov = {**DEFAULTS, **parse_overrides(argv)}
    degrees = [int(x) for x in ov.pop("degrees", "2,4").split(",")]
    pools = PoolCache()
    h, s, b = int(ov["hidden_size"]), int(ov["seq_length"]), int(ov["micro_batch_size"])
    print(f"b={b} s={s} h={h} fp32; bytes one rank sends for one layer: measured per training "
          "step (fwd+bwd), closed form of the forward")
    print(f"{'P':>3} {'Ulysses step':>13} {'fwd formula':>12} {'Megatron-SP step':>17} "
          f"{'fwd formula':>12} {'step ratio':>11} {'fwd ratio':>10} {'paper 4Nh/P':>12} "
          f"{'paper 4Nh':>10}  verdicts")
    try:
        for p in degrees:
            uly, ok_u = per_layer_fwd_bytes(pools, ov, *SCHEMES["ulysses"], p)
            msp, ok_m = per_layer_fwd_bytes(pools, ov, *SCHEMES["megatron-sp"], p)
            f = ulysses_vs_megatron_sp(b, s, h, p)
            print(f"{p:>3} {uly:>13.0f} {f['ulysses_fwd_bytes_per_layer']:>12.0f} {msp:>17.0f} "
                  f"{f['megatron_sp_fwd_bytes_per_layer']:>12.0f} {msp / uly:>11.2f} "
                  f"{f['ratio_megatron_sp_over_ulysses']:>10.2f} "
                  f"{f['paper_ulysses_per_link']:>12.0f} {f['paper_megatron_sp_per_link']:>10.0f}"
                  f"  {'pass' if ok_u and ok_m else 'FAIL'}")
    finally:
        pools.close()


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="issue_4217",
                           kept="the lines printed above are what it measured"))
