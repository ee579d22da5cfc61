"""Mixture-of-experts block and the dense MLP. Routing (`Gating`): softmax top-k with optional
renormalisation (Qwen3-MoE), or DeepSeek-V3's `noaux_tc` (sigmoid scores, a correction bias that only
chooses, group-limited top-k, a scaling factor); DeepSeek's shared experts run beside the routed ones.

Weights are stored input-major ([in, out], the transpose of HF's nn.Linear layout): `x @ w` with a
contiguous [in, out] matrix is up to 5x faster than `F.linear` for the small row counts of decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.kernels.cpu import ops as cpu_ops
from kvferry.model.layers import int8_linear, linear
from kvferry.model.parallel import Comm, expert_owner, expert_range


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [..., 2I] -> [..., I], computed in place in the gate half of `gate_up`.

    Callers pass a fresh matmul output; reusing it saves two allocations and a pass over memory.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


class DenseMLP(nn.Module):
    PACKED = ("w13", "w2")

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(hidden, 2 * intermediate), requires_grad=False)  # [gate | up]
        self.w2 = nn.Parameter(torch.empty(intermediate, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self.w13, "out_features"):  # packed for the C++ kernels: one call, their SiLU
            return cpu_ops().gated_mlp(x, self.w13, self.w2)
        return linear(silu_and_mul(linear(x, self.w13)), self.w2)


@dataclass(frozen=True)
class Gating:
    """How a MoE layer's router chooses its experts."""

    top_k: int
    renormalize: bool
    sigmoid: bool = False  # DeepSeek-V3's noaux_tc (`grouped_route`); else softmax top-k (`route`)
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor

    @classmethod
    def of(cls, cfg) -> Gating:
        return cls(
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.sigmoid_routing,
            cfg.n_group,
            cfg.topk_group,
            cfg.routed_scaling_factor,
        )


def grouped_route(
    x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, g: Gating
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's `noaux_tc` routing (as transformers computes it, in float32): sigmoid scores; the
    scores plus the correction `bias` choose: the `topk_group` groups whose two best experts score
    highest, then the top k experts in them; the weights are the chosen experts' scores (renormalised
    if asked), times `scaling`. x: [T, H], router: [H, E], bias: [E] -> (weights [T, k], ids [T, k])."""
    scores = (x.float() @ router.float()).sigmoid()
    choice = scores + bias
    if g.topk_group < g.n_group:
        tokens, experts = choice.shape
        best = choice.view(tokens, g.n_group, experts // g.n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        kept = torch.topk(best, g.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(experts // g.n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, g.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if g.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * g.scaling).to(x.dtype), ids


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H], router: [H, E] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
    probs = torch.softmax(x @ router, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def experts_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """Apply the experts in w13/w2 (global ids first_expert..first_expert+E_local-1) to their tokens.

    x: [T, H]; ids, weights: [T, k]; w13: [E_local, H, 2I]; w2: [E_local, I, H]. Assignments to experts
    outside the local range are skipped. Returns [T, H], the weighted sum over the local experts.
    Weights packed for the CPU kernels run as one kernel call. Otherwise decode-sized batches that spread
    over the experts run as one padded batched matmul (at most half the rows padding), and the rest
    (prefill, or a few tokens on a few experts) as one matmul per hit expert.
    """
    if hasattr(w13, "out_features"):
        return cpu_ops().moe_experts(x, ids, weights, w13, w2, first_expert)
    int8 = hasattr(w13, "int8_scale")  # `--quantization int8` off the CPU kernels: W8A8 per expert, looped
    num_local, top_k = w13.shape[0], ids.shape[1]
    local = ids.flatten() - first_expert
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local.clamp(-1, num_local).add(1), minlength=num_local + 2)[1:-1]
    # one host sync: assignments to lower-numbered remote experts (they sort first), local ones, widest expert
    begin, num_sel, width = torch.stack(((local < 0).sum(), counts.sum(), counts.max())).tolist()
    if num_sel == 0:  # none of these tokens chose a local expert (or there are no tokens)
        return torch.zeros_like(x)
    sel = order[begin : begin + num_sel]  # local assignments, grouped by expert
    token, scale = sel // top_k, weights.flatten()[sel, None]
    if not int8 and x.shape[0] <= PADDED_MAX_TOKENS and width * num_local <= 2 * sel.numel():
        y = _padded_experts(x[token], local[sel], counts, width, w13, w2)
    else:
        y = _looped_experts(x[token], counts.tolist(), w13, w2)
    return torch.zeros_like(x).index_add_(0, token, y * scale)


PADDED_MAX_TOKENS = 128


def _padded_experts(xs: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, width: int, w13, w2):
    """xs: [N, H] rows grouped by `expert` [N]. One bmm per projection over [E_local, width, H]."""
    slot = torch.arange(xs.shape[0], device=xs.device) - (torch.cumsum(counts, 0) - counts)[expert]
    padded = xs.new_empty(w13.shape[0], width, xs.shape[1])  # padding rows are computed, never read
    padded[expert, slot] = xs
    return torch.bmm(silu_and_mul(torch.bmm(padded, w13)), w2)[expert, slot]


def _looped_experts(xs: torch.Tensor, counts: list[int], w13, w2) -> torch.Tensor:
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            rows = xs[start : start + count]
            if hasattr(w13, "int8_scale"):
                h = int8_linear(rows, w13[expert], w13.int8_scale[expert])
                outputs.append(int8_linear(silu_and_mul(h), w2[expert], w2.int8_scale[expert]))
            else:
                outputs.append(silu_and_mul(rows @ w13[expert]) @ w2[expert])
            start += count
    return torch.cat(outputs) if outputs else xs


class _Routed(nn.Module):
    """What both MoE blocks share: the router (and DeepSeek's correction bias `e_bias`), the gating, the
    shared experts (`shared`, a DenseMLP, or None)."""

    def _init_routing(self, hidden: int, num_experts: int, gating: Gating, shared_intermediate: int) -> None:
        self.router = nn.Parameter(torch.empty(hidden, num_experts), requires_grad=False)
        if gating.sigmoid:
            self.e_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        self.gating = gating
        self.top_k, self.renormalize = gating.top_k, gating.renormalize
        self.shared = DenseMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.triton = False  # the Triton kernels: routing, then the fused grouped GEMMs (`use_triton`)
        self.cpu_kernels = False  # the C++ kernels (`pack_weights`): grouped routing in one call

    def choose(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for the tokens x [T, H]."""
        g = self.gating
        if g.sigmoid and self.cpu_kernels:  # the router's logits and the choice in one call
            xf, router = x.float(), self.router.float()
            weights, ids = cpu_ops().grouped_route(
                xf, router, self.e_bias, g.top_k, g.renormalize, g.n_group, g.topk_group, g.scaling
            )
            return weights.to(x.dtype), ids
        if g.sigmoid:
            return grouped_route(x, self.router, self.e_bias, g)
        return (triton_route if self.triton else route)(x, self.router, self.top_k, self.renormalize)

    def with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        return routed if self.shared is None else routed.add_(self.shared(x))


class SparseMoeBlock(_Routed):
    PACKED = ("w13", "w2")

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        gating: Gating | None = None,
        shared_intermediate: int = 0,
    ):
        super().__init__()
        self._init_routing(hidden, num_experts, gating or Gating(top_k, renormalize), shared_intermediate)
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, intermediate, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.choose(x)
        if self.triton and not hasattr(self.w13, "int8_scale"):  # int8 experts: experts_forward's W8A8
            from kvferry.kernels import triton_moe

            return self.with_shared(x, triton_moe.fused_moe(x, ids, weights, self.w13, self.w2))
        return self.with_shared(x, experts_forward(x, ids, weights, self.w13, self.w2))


def triton_route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` with the Triton softmax + top-k kernel over the router logits."""
    from kvferry.kernels import triton_moe

    weights, ids = triton_moe.route_topk(x @ router, top_k, renormalize)
    return weights.to(x.dtype), ids


class ExpertLoad:
    """What one rank's expert-parallel MoE layer did: assignments per local expert, seconds computing."""

    def __init__(self, num_local: int):
        self.num_local = num_local
        self.tokens: torch.Tensor | None = None  # [num_local] int64, made on first use (on x's device)
        self.seconds = 0.0

    def add(self, counts: torch.Tensor, seconds: float) -> None:
        self.tokens = counts if self.tokens is None else self.tokens + counts
        self.seconds += seconds

    def token_counts(self) -> list[int]:
        return [0] * self.num_local if self.tokens is None else self.tokens.tolist()


def dispatch_combine(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    comm: Comm,
    owner: torch.Tensor,
    first_expert: int,
    load: ExpertLoad | None = None,
    triton: bool = False,
) -> torch.Tensor:
    """Expert-parallel MoE: send each token to the ranks owning its chosen experts, combine the results.

    x: [T, H] this rank's tokens (T may be 0: the rank still takes part); ids, weights: [T, k] the
    router's choices; w13/w2: this rank's experts, global ids first_expert .. first_expert+E_local-1;
    owner: [E] the rank holding each expert (`parallel.expert_owner`: ranks may hold different counts).
    A token goes once to each rank that owns at least one of its k experts, carrying all k ids and
    weights; that rank applies its own experts (weighted) and sends back one partial sum, which the
    source adds up. Three all_to_all per layer: counts, token rows with their (ids, weights) as extra
    columns, results (four when the activation dtype cannot hold the expert ids exactly).
    `triton`: the dispatch layout and the local experts run the Triton kernels.
    """
    num_tokens, top_k = ids.shape
    ranks, num_local = comm.size, w13.shape[0]
    if triton:
        from kvferry.kernels import triton_moe

        token, send_counts = triton_moe.ep_dispatch_layout(ids, owner, ranks)
    else:
        needs = torch.zeros(num_tokens, ranks, dtype=torch.bool, device=x.device)
        needs.scatter_(1, owner[ids], True)
        token = needs.t().nonzero()[:, 1]  # the (rank, token) pairs' tokens, grouped by destination rank
        send_counts = needs.sum(0)
    recv_counts = torch.empty_like(send_counts)
    ones = [1] * ranks
    comm.all_to_all(recv_counts, send_counts, ones, ones)
    counts = torch.cat((send_counts, recv_counts)).tolist()  # one host sync for both
    send_splits, recv_splits = counts[:ranks], counts[ranks:]
    num_recv, hidden = sum(recv_splits), x.shape[1]
    # the ids and weights travel as extra columns of the rows when x's dtype holds the ids exactly
    # (float32, or experts <= 256 in 16-bit floats): one all_to_all for both; else a separate one
    inline = INLINE_METADATA and owner.numel() <= _EXACT_INTS.get(x.dtype, 0)
    if inline:
        payload = torch.cat((x[token], ids[token].to(x.dtype), weights[token]), dim=1)
        recv = x.new_empty(num_recv, hidden + 2 * top_k)
        comm.all_to_all(recv, payload, recv_splits, send_splits)
        recv_x, recv_ids, recv_weights = (
            recv[:, :hidden],
            recv[:, hidden : hidden + top_k].long(),
            recv[:, -top_k:],
        )
    else:
        recv_x = x.new_empty(num_recv, hidden)
        comm.all_to_all(recv_x, x[token], recv_splits, send_splits)
        meta = torch.cat((ids[token].float(), weights[token].float()), dim=1)  # exact in float32
        recv_meta = meta.new_empty(num_recv, 2 * top_k)
        comm.all_to_all(recv_meta, meta, recv_splits, send_splits)
        recv_ids, recv_weights = recv_meta[:, :top_k].long(), recv_meta[:, top_k:].to(x.dtype)
    first = first_expert
    started = time.perf_counter()
    if triton and not hasattr(w13, "int8_scale"):
        from kvferry.kernels import triton_moe

        partial = triton_moe.fused_moe(recv_x, recv_ids, recv_weights, w13, w2, first)
    else:
        partial = experts_forward(recv_x, recv_ids, recv_weights, w13, w2, first)
    if load is not None:
        local = (recv_ids - first).flatten()
        mine = (local >= 0) & (local < num_local)
        load.add(torch.bincount(local[mine], minlength=num_local), time.perf_counter() - started)
    back = x.new_empty(token.shape[0], x.shape[1])
    comm.all_to_all(back, partial, send_splits, recv_splits)
    return torch.zeros_like(x).index_add_(0, token, back)


INLINE_METADATA = True  # send expert ids/weights as extra columns of the rows where the dtype allows
_EXACT_INTS = {torch.float32: 2**24, torch.float16: 2048, torch.bfloat16: 256}  # integers held exactly


class ExpertParallelMoe(_Routed):
    """The MoE block with experts partitioned across an EP group (router and top-k as SparseMoeBlock):
    rank r holds `parallel.expert_range(E, M, r)`, the first E mod M ranks one expert more. Shared
    experts (DeepSeek) are on every rank: each applies them to its own tokens."""

    PACKED = ("w13", "w2")

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        comm: Comm,
        gating: Gating | None = None,
        shared_intermediate: int = 0,
    ):
        super().__init__()
        experts = expert_range(num_experts, comm.size, comm.rank)
        num_local = len(experts)
        self._init_routing(hidden, num_experts, gating or Gating(top_k, renormalize), shared_intermediate)
        self.w13 = nn.Parameter(torch.empty(num_local, hidden, 2 * intermediate), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, intermediate, hidden), requires_grad=False)
        self.comm = comm
        self.first_expert = experts.start
        self.owner = expert_owner(num_experts, comm.size)  # global expert -> rank (moved to x's device)
        self.load = ExpertLoad(num_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.choose(x)
        if self.owner.device != x.device:
            self.owner = self.owner.to(x.device)
        routed = dispatch_combine(
            x,
            ids,
            weights,
            self.w13,
            self.w2,
            self.comm,
            self.owner,
            self.first_expert,
            self.load,
            self.triton,
        )
        return self.with_shared(x, routed)
