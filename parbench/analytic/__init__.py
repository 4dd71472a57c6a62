"""Closed-form models of parameters, FLOPs, memory and communication (see DESIGN.md).

Pure functions of plain numbers or a :class:`Shape`; no torch, no process groups.
Modules: :mod:`.shape` (the model shape, units, input checks), :mod:`.params`, :mod:`.flops`,
:mod:`.memory` (ZeRO model states, KV cache), :mod:`.activations`, :mod:`.comm`
(per-collective wire bytes and per-parallelism traffic), :mod:`.traffic` (UB-Mesh Table 1),
:mod:`.estimate` (the whole model of one configuration, as a typed ``Estimate``; how to count
in :mod:`.counting`).
"""
from .activations import (first_stage_activation_bytes, korthikanti_layer_bytes,
                          layer_activation_bytes, reference_layer_activation_bytes)
from .comm import (Transfer, cp_allgather_traffic, ddp_traffic, expert_traffic,
                   pipeline_p2p_traffic, pipeline_total_sends, ring_attention_traffic,
                   summarize, tp_traffic, tp_vocab_traffic, ulysses_paper_per_link,
                   ulysses_traffic, wire_bytes, wire_factor, zero_traffic)
from .counting import Counting
from .estimate import Estimate, ParamsEstimate, estimate, estimate_params
from .flops import (achieved_flops, forward_flops, megatron_eq3_flops, mfu,
                    params_rule_flops, shape_forward_flops, shape_training_flops,
                    training_flops, training_time_estimate)
from .memory import (ACCOUNTINGS, FP32_ADAMW, MIXED_ADAM, MIXED_ADAM_FP32_GRAD, Accounting,
                     ModelStates, kv_cache_bytes, largest_model_fits, shard_numel, shard_range,
                     zero_model_states, zero_model_states_exact, zero_table)
from .params import (active_params, embedding_params, head_params, layer_breakdown,
                     layer_params, param_counts, split_layers, stage_params,
                     textbook_layer_params, textbook_total_params, total_params)
from .shape import GB, GiB, MiB, Shape, shape_from
from .traffic import (TRAFFIC_PRESETS, CellCheck, TrafficRow, UBMeshMoE2T, compare_with_published,
                      field_sources, published_ubmesh_table, traffic_table)

__all__ = [name for name in dir() if not name.startswith("_")]
