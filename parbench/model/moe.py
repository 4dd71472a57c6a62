"""The mixture-of-experts layer of the reference model: routing, capacity, dropping, the
auxiliary losses -- the specification every expert-parallel scheme must equal.

Semantics (stated once, here):

- **Router** (Switch, Fedus et al. 2021, Sec. 2.1; GShard, Lepikhin et al. 2020, Sec. 2.2):
  logits = x W_r^T in fp32 (W_r: ``[E, h]``, no bias), p = softmax(logits); the top-k experts
  of each token by p. Gates: k = 1 (Switch) the chosen expert's probability; k > 1 (GShard
  top-2) the top-k probabilities renormalised to sum to 1.
- **Router skew** (``moe_router_skew`` = a >= 0, a benchmark knob, not from a paper): a
  fixed bias b_e = -a sigma e / (E - 1) added to the logits (0 for E = 1), sigma =
  init_std sqrt(h) the router's logit scale at initialisation (the standard deviation of a
  logit of a unit-variance token), so that low-numbered experts are popular -- the skewed
  expert popularity FasterMoE measures (He et al. 2022, Sec. 2.3). a = 1 shifts neighbouring
  experts by sigma / (E - 1); a = 0 adds nothing (the logits are bit-identical).
- **Routing groups.** Capacity and the auxiliary losses are computed per routing group: the
  tokens one rank routes in one micro-batch ("per rank", GShard's local groups, DeepSpeed's
  and Megatron's rule), never globally. The golden run holds the whole batch, so it is told the
  grouping (``RoutingGroups``): rows of ``rows`` consecutive samples (a micro-batch) times a
  chunk id per sequence position (the context-parallel and tensor-parallel token split).
- **Capacity** (Switch Eq. 3): per expert and group, C = ceil(capacity_factor * k * T / E)
  for T tokens in the group; ``capacity_factor = 0`` means no limit (C = T).
- **Deterministic dropping.** Within a group tokens are ordered position-major, then by
  sample (the order of Megatron's ``[s, b]`` activations flattened). All first choices take
  slots before any second choice (GShard Algorithm 1); within one choice level slots go in
  token order. An assignment whose slot index is >= C is dropped: it contributes nothing,
  and the token passes through the residual.
- **Load-balancing loss** (Switch Eq. 4 with top-k counts): aux = E * sum_e f_e P_e, f_e the
  fraction of the group's k T assignments (before dropping) routed to e, P_e the group's mean
  router probability of e. **Router z-loss** (ST-MoE, Zoph et al. 2022, Eq. 5): the group's
  mean of logsumexp(logits)^2. Each layer adds coef_aux * aux + coef_z * z, averaged over its
  groups, to the loss -- by gradient only (``AttachAux``, as Megatron's auxiliary-loss
  scaler), so the reported loss is the token cross-entropy in every scheme and in the golden
  run. A scheme that holds one group per micro-batch scales its groups' terms so that the
  sum over all ranks and micro-batches is the mean over groups (``aux_scale``).
- **DeepSeek-style layers** (DeepSeek-V3 Technical Report, arXiv 2412.19437, Sec. 2.1.2):
  fine-grained experts (``moe_ffn_hidden_size``), a shared expert added to the routed output
  (Eq. 12), the first ``moe_first_dense`` layers dense; the sigmoid router, the balancing
  bias and group-limited routing are ``parbench.model.router``'s. The bias is updated after
  each step from the step's global load (``update_expert_bias``).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..analytic.shape import expert_capacity
from .blocks import MLP
from .router import (RouterRule, add_bias_buffer, balance_choice, balance_scores, bias_of,
                     rule_of, scores_of, select, updated_bias)


def is_moe_layer(cfg, i: int) -> bool:
    """Layer ``i`` is an MoE layer: after the first ``moe_first_dense`` dense layers
    (DeepSeek's first_k_dense_replace), every ``moe_every``-th (Megatron-Core's
    ``moe_layer_freq``) -- ``analytic.shape.Shape.is_moe_layer``'s rule."""
    k = cfg.moe_first_dense
    return cfg.num_experts > 0 and i >= k and (i - k) % cfg.moe_every == 0


def capacity(capacity_factor: float, k: int, tokens: int, num_experts: int) -> int:
    """Slots per expert in a group of ``tokens`` (Switch Eq. 3, the factor read as the decimal
    it prints as: ``analytic.shape.expert_capacity``); no limit (``tokens``) when the factor
    is 0."""
    c = expert_capacity(tokens, num_experts, k, capacity_factor)
    return tokens if c is None else c


@dataclass(frozen=True)
class RoutingGroups:
    """How the golden run cuts a ``[b, s]`` batch into the groups the ranks route: samples
    in blocks of ``rows``; position j in chunk ``chunks[j]`` (None: one chunk)."""

    rows: int
    chunks: tuple[int, ...] | None = None

    @property
    def num_chunks(self) -> int:
        return 1 + max(self.chunks) if self.chunks else 1

    def ids(self, b: int, s: int) -> torch.Tensor:
        """Group id of every token, flattened position-major ``[s * b]``."""
        row = torch.arange(b) // self.rows
        chunk = torch.tensor(self.chunks[:s]) if self.chunks else torch.zeros(s, dtype=torch.long)
        return (row.unsqueeze(0) * self.num_chunks + chunk.unsqueeze(1)).reshape(-1)

    def key(self) -> list:
        return [self.rows, list(self.chunks) if self.chunks else None]

    @classmethod
    def from_key(cls, key: list) -> "RoutingGroups":
        """The groups whose ``key()`` is ``key`` (as a golden file's manifest stores it)."""
        rows, chunks = key
        return cls(rows, tuple(chunks) if chunks else None)


@dataclass
class Routing:
    """The routing of ``T`` tokens: per token and choice the expert, the gate, the slot in
    the expert's buffer of its group and whether it was kept; per group the capacity."""

    expert: torch.Tensor  # [T, k] long
    gate: torch.Tensor  # [T, k] float (differentiable)
    slot: torch.Tensor  # [T, k] long
    kept: torch.Tensor  # [T, k] bool
    capacity: int  # the largest group's capacity (equal groups: every group's)
    aux: torch.Tensor  # scalar: mean over groups of coef_aux aux + coef_z z (differentiable)
    stats: dict


def router_logits(x: torch.Tensor, weight: torch.Tensor, skew: float = 0.0,
                  scale: float = 1.0) -> torch.Tensor:
    """x W_r^T in fp32, plus the router skew's bias -skew scale e / (E - 1) (``scale``: the
    logit scale sigma, module docstring)."""
    logits = x.float() @ weight.float().t()
    if skew:
        e = weight.shape[0]
        bias = torch.arange(e, device=logits.device, dtype=logits.dtype) / max(e - 1, 1)
        logits = logits - (skew * scale) * bias
    return logits


def skew_of(cfg) -> tuple[float, float]:
    """(skew, logit scale init_std sqrt(h)) of a model config: ``route``'s last two
    arguments."""
    return cfg.moe_router_skew, cfg.init_std * cfg.hidden_size ** 0.5


def route(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor, k: int,
          capacity_factor: float, aux_coef: float, z_coef: float, skew: float = 0.0,
          scale: float = 1.0, *, rule: RouterRule = RouterRule(),
          bias: torch.Tensor | None = None, choose=select, counted_by=balance_choice
          ) -> Routing:
    """Route tokens ``x`` ``[T, h]`` in groups ``groups`` ``[T]`` (tokens of a group in
    priority order); ``skew``, ``scale``: the router skew and the logit scale (module
    docstring, ``skew_of``); ``rule`` and ``bias``: the scores, the group limit and the
    balancing bias of the choice (``parbench.model.router``; ``choose``: its ``select``;
    ``counted_by``: the experts the balancing loss counts, its ``balance_choice``).
    ``stats["group_load"]``
    ``[G, E]``: the assignments of each group (ascending group id) to each expert;
    ``stats["load"]`` their sum, before dropping (the bias update's load)."""
    num_experts = weight.shape[0]
    logits = router_logits(x, weight, skew, scale)
    scores = scores_of(logits, rule)
    top_e, gate = choose(scores, k, rule, bias)
    probs = balance_scores(scores, rule)
    counted = counted_by(scores, top_e, k, rule, bias)
    slot = torch.zeros_like(top_e)
    kept = torch.zeros_like(top_e, dtype=torch.bool)
    aux_terms, cap, group_load = [], 0, []
    load = torch.zeros(num_experts, dtype=torch.long)
    dropped = torch.zeros(num_experts, dtype=torch.long)
    aux_val = z_val = 0.0
    for g in torch.unique(groups).tolist():
        idx = (groups == g).nonzero().squeeze(1)
        t = idx.numel()
        c = capacity(capacity_factor, k, t, num_experts)
        cap = max(cap, c)
        taken = torch.zeros(num_experts, dtype=torch.long)
        for j in range(k):
            onehot = F.one_hot(top_e[idx, j], num_experts)
            pos = (onehot.cumsum(0) - 1 + taken).gather(1, top_e[idx, j:j + 1]).squeeze(1)
            slot[idx, j] = pos
            taken += onehot.sum(0)
        load += taken.cpu()
        group_load.append(taken.cpu())
        kept[idx] = slot[idx] < c
        dropped += torch.bincount(top_e[idx][~kept[idx]].cpu(), minlength=num_experts)
        hits = taken if counted is top_e else \
            F.one_hot(counted[idx], num_experts).sum((0, 1)).cpu()
        f = hits.to(probs.device, probs.dtype) / (t * k)
        aux = num_experts * (f * probs[idx].mean(0)).sum()
        z = torch.logsumexp(logits[idx], dim=-1).pow(2).mean()
        aux_terms.append(aux_coef * aux + z_coef * z)
        aux_val += float(aux.detach())
        z_val += float(z.detach())
    n = len(aux_terms)
    stats = {"aux_loss": aux_val / n, "z_loss": z_val / n, "load": load, "dropped": dropped,
             "capacity": cap, "groups": n, "group_load": torch.stack(group_load)}
    return Routing(top_e, gate, slot, kept, cap, torch.stack(aux_terms).mean(), stats)


class AttachAux(torch.autograd.Function):
    """Identity on ``y``; in backward the auxiliary loss ``aux`` receives gradient 1, as if
    it had been added to the loss (Megatron-Core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.save_for_backward(aux)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def expert_mlp(x: torch.Tensor, fc1, fc2) -> torch.Tensor:
    """One expert: the dense MLP's arithmetic (``blocks.MLP``): h -> f -> h with GELU, or
    SwiGLU when ``fc1`` holds [gate; up] (2f rows for fc2's f inputs: Mixtral's experts,
    Jiang et al. 2024, Sec. 2.1); biases where the model has them."""
    u = F.linear(x, fc1.weight, fc1.bias)
    if fc1.weight.shape[0] == 2 * fc2.weight.shape[1]:
        gate, up = u.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, fc2.weight, fc2.bias)
    return F.linear(F.gelu(u), fc2.weight, fc2.bias)


def expert_tensors(ex) -> list[torch.Tensor]:
    """One expert's tensors in the flat order of the schemes that move whole experts: fc1's
    weight and bias, fc2's weight and bias (no biases under ``bias=false``)."""
    return [t for t in (ex.fc1.weight, ex.fc1.bias, ex.fc2.weight, ex.fc2.bias)
            if t is not None]


def expert_from(parts: list[torch.Tensor], like) -> SimpleNamespace:
    """``expert_tensors``' list back as an expert (``.fc1.weight`` ...) shaped like
    ``like``."""
    w1, b1, w2, b2 = parts if like.fc1.bias is not None else (parts[0], None, parts[1], None)
    return SimpleNamespace(fc1=SimpleNamespace(weight=w1, bias=b1),
                           fc2=SimpleNamespace(weight=w2, bias=b2))


def combine_reference(x: torch.Tensor, r: Routing, experts) -> torch.Tensor:
    """The single-device MoE output: sum over kept assignments of gate * expert(token). An
    expert without tokens still runs (on no rows), so that its gradient is zero, not None:
    the optimizer then decays it as every scheme's flat gradient buffer does."""
    out = torch.zeros_like(x)
    for e, ex in enumerate(experts):
        tok, choice = ((r.expert == e) & r.kept).nonzero(as_tuple=True)
        y = expert_mlp(x[tok], ex.fc1, ex.fc2) * r.gate[tok, choice].unsqueeze(1).to(x.dtype)
        out = out.index_add(0, tok, y)
    return out


class MoE(nn.Module):
    """Router plus E expert MLPs replacing a layer's MLP (names ``mlp.router.weight``,
    ``mlp.experts.{e}.fc1.weight``, ...), each of hidden size ``moe_ffn_hidden_size`` (0: the
    dense MLP's); with ``moe_shared_expert_size`` an always-on ``mlp.shared_expert`` MLP whose
    output is added to the routed one (DeepSeek-V3 Eq. 12; Megatron-Core's SharedExpertMLP,
    ungated); with ``moe_bias_update_rate`` the router's balancing bias buffer
    ``mlp.router.expert_bias`` (``parbench.model.router``). Input ``[b, s, h]``."""

    def __init__(self, cfg, routing: RoutingGroups | None = None):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if cfg.moe_bias_update_rate:
            add_bias_buffer(self.router, cfg.num_experts)
        self.experts = nn.ModuleList([MLP(cfg, cfg.moe_ffn_hidden_size)
                                      for _ in range(cfg.num_experts)])
        if cfg.moe_shared_expert_size:
            self.shared_expert = MLP(cfg, cfg.moe_shared_expert_size)
        self.routing = routing
        #: multiplies this layer's auxiliary terms (see the module docstring)
        self.aux_scale = 1.0
        #: the last forward's routing statistics (load, dropped, aux / z loss)
        self.last: dict = {}
        #: assignments per expert routed since the last bias update (``update_expert_bias``)
        self.step_load = torch.zeros(cfg.num_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        xt = x.transpose(0, 1).reshape(s * b, h)
        groups = (self.routing or RoutingGroups(rows=b)).ids(b, s).to(x.device)
        cfg = self.cfg
        r = route(xt, self.router.weight, groups, cfg.moe_top_k, cfg.moe_capacity_factor,
                  cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef, *skew_of(cfg),
                  rule=rule_of(cfg), bias=bias_of(self.router))
        self.last = r.stats
        self.step_load = self.step_load + r.stats["load"]
        y = combine_reference(xt, r, self.experts)
        y = AttachAux.apply(y, r.aux * self.aux_scale)
        if cfg.moe_shared_expert_size:
            y = y + self.shared_expert(xt)
        return y.view(s, b, h).transpose(0, 1)


def set_aux_scale(module: nn.Module, scale: float) -> None:
    """Set ``aux_scale`` on every MoE layer of ``module``."""
    for m in module.modules():
        if hasattr(m, "aux_scale"):
            m.aux_scale = scale


def reset_step_loads(model: nn.Module) -> None:
    """Forget the loads routed so far (before a step whose loads update the bias)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.step_load = torch.zeros_like(m.step_load)


def update_expert_bias(model: nn.Module) -> None:
    """The single-device bias update after a step (DeepSeek-V3 Sec. 2.1.2): each MoE layer's
    bias moves by gamma sign(mean load - load) with the loads of every forward since the last
    update -- the whole global batch, so the global load -- which are then forgotten."""
    for m in model.modules():
        if isinstance(m, MoE):
            bias = bias_of(m.router)
            if bias is not None:
                with torch.no_grad():
                    bias.copy_(updated_bias(bias, m.step_load, m.cfg.moe_bias_update_rate))
            m.step_load = torch.zeros_like(m.step_load)
