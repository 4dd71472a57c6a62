"""Finding: Megatron-Core 0.16.1's auxiliary-loss-free balancing bias never moves in
capacity mode with padding; minimal reproducer (one CPU process, Megatron-Core's own
routing functions, no distributed setup).

DeepSeek-V3 (arXiv 2412.19437, Sec. 2.1.2) updates each expert's bias after a step by
b_i += gamma sign(mean_j load_j - load_i), load_i the tokens routed to expert i.
Megatron-Core's ``TopKRouter.routing`` (megatron/core/transformer/moe/router.py) chooses
the experts (``topk_routing_with_score_function``), then, with a capacity factor, calls
``apply_router_token_dropping``, and only then counts the load for the bias
(``_apply_expert_bias``: ``local_tokens_per_expert += routing_map.sum(dim=0)``). With
``moe_pad_expert_input_to_capacity`` that function returns the *capacity mask* as the
routing map (moe_utils.py: ``final_map = capacity_mask``): every expert's column holds
exactly its capacity (all tokens when the capacity is not below them), whatever the router
chose. The counts are therefore equal for every expert, ``get_updated_expert_bias`` finds
``sign(mean - load) = 0``, and the bias stays at zero for the whole run; the routing itself
is unaffected (the padded entries carry probability 0).

parbench's ``baseline.megatron.gpt-moe-bias`` rows show it (capacity mode is the one
Megatron-Core dispatch that runs on gloo): the routers' bias stays 0 where the golden run's
moves by gamma after the first step. Run: ``PYTHONPATH=. python
scripts/megatron_expert_bias_capacity_repro.py`` (needs megatron-core).
"""
from __future__ import annotations

import torch


def loads(pad_to_capacity: bool, capacity_factor: float) -> torch.Tensor:
    """The per-expert counts ``_apply_expert_bias`` adds for 32 tokens, 8 experts, top-2
    sigmoid routing (DeepSeek-V3's score function)."""
    from megatron.core.transformer.moe.moe_utils import (apply_router_token_dropping,
                                                         topk_routing_with_score_function)
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    probs, routing_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=False,
                                                          score_function="sigmoid")
    chosen = routing_map.sum(dim=0)
    _, counted = apply_router_token_dropping(probs, routing_map, router_topk=2,
                                             capacity_factor=capacity_factor,
                                             drop_policy="position",
                                             pad_to_capacity=pad_to_capacity)
    print(f"pad_to_capacity={pad_to_capacity}, capacity factor {capacity_factor}: chosen "
          f"{chosen.tolist()}, counted {counted.sum(dim=0).tolist()}")
    return counted.sum(dim=0).float()


def main() -> int:
    for cf in (4.0, 1.0):  # no token dropped / some dropped
        padded = loads(True, cf)
        moved = torch.sign(padded.mean() - padded)
        print(f"  bias step direction with padding: {moved.tolist()}")
        if moved.any():
            print("not reproduced: the padded counts differ between experts")
            return 1
    unpadded = loads(False, 4.0)
    print(f"  without padding: {torch.sign(unpadded.mean() - unpadded).tolist()}")
    print("reproduced: with padding the bias's load is the capacity mask, uniform")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
