"""Top-k / top-p draws for the sampler: over a few candidates instead of the sorted vocabulary.

Both paths rank a row's tokens by (value descending, token id ascending), so ties at the k-th value are
broken by the token id and top-k keeps exactly k tokens. The Gumbel noise is a pure function of (seed, step,
token id) (`sampler.uniform_noise`), so evaluating it only at the candidates' ids gives exactly the token the
full-vocabulary draw gives. `full_sort_draw` is that full-vocabulary path: the one for top_p < 1 without
top_k, and the reference the tests hold `candidate_draw` to.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
# The largest float32 below 1. (m + 0.5) / 2**24 rounds to 1.0 for the top 24-bit value m, whose Gumbel noise
# -log(-log(u)) would be +inf: that token always won, and a masked one (-inf + inf = NaN) won argmax too.
U_MAX = 1.0 - 2.0 ** -24


def hash32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    return (x >> 16) ^ x


def row_hash(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The per-row start of the noise hash (the same as sampler.uniform_noise and the fused kernel)."""
    return hash32(hash32(seeds & M32) ^ (steps & M32))


def noise_at(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) at token ids `ids` [R, C] for rows whose hash start is `rows` [R]."""
    bits = hash32((rows[:, None] + ids * 0x9E3779B1) & M32)
    return (((bits >> 8).float() + 0.5) / float(1 << 24)).clamp_(max=U_MAX)


def _gumbel_pick(x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """argmax of x + Gumbel noise over each row's columns (masked ones are -inf); ties go to the lowest id,
    as torch.argmax over the whole vocabulary does. A NaN wins (the lowest id of the NaNs), as in the greedy
    and temperature draws: a NaN maximum would match no column and give the id `vocab`, past the embedding."""
    g = x - torch.log(-torch.log(noise_at(rows, ids)))
    nan = g.isnan()
    best = g.masked_fill(nan, float("-inf")).max(dim=-1, keepdim=True).values
    hit = torch.where(nan.any(dim=-1, keepdim=True), nan, g == best)
    return ids.masked_fill(~hit, vocab).min(dim=-1).values


def _mask_sorted(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vals [R, C] sorted descending per row -> the same with the tokens top-k and top-p drop set to -inf."""
    cols = torch.arange(vals.shape[-1], device=vals.device)
    vals = vals.masked_fill(cols[None, :] >= top_k[:, None], float("-inf"))
    probs = vals.softmax(-1)
    # keep the smallest prefix whose mass reaches top_p: a token goes once the mass before it does (as in
    # transformers); top_p = 1 keeps every token even where that sum rounds to 1
    drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1)
    return vals.masked_fill(drop, float("-inf"))


def order_key(x: torch.Tensor) -> torch.Tensor:
    """One int64 per token that orders like (value descending, id ascending): float bits made
    monotonic in the high half, the reversed id in the low half. No two tokens share a key, so
    torch.topk's order is exact."""
    # + 0.0: -0.0 becomes +0.0, so equal values get equal bits; every NaN the same positive one, ranked first
    bits = (x + 0.0).masked_fill_(x.isnan(), float("nan")).view(torch.int32)
    bits ^= (bits >> 31) & 0x7FFFFFFF  # negative floats: reverse the order of their magnitudes
    reversed_ids = torch.arange(x.shape[-1] - 1, -1, -1, device=x.device, dtype=torch.int64)
    # in place: [R, vocab] int64 once
    return bits.to(torch.int64).bitwise_left_shift_(32).bitwise_or_(reversed_ids)


def top_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ids [R, k] of each row's k largest values of x [R, vocab] in the order of `order_key`."""
    return order_key(x).topk(k, dim=-1, sorted=True).indices


def candidate_draw(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor,
                   max_k: int) -> torch.Tensor:
    """x [R, vocab] (logits / temperature); top_k [R] int64 in [1, vocab], max_k >= every top_k (a host
    int, so no wait for the device); top_p [R] fp32; rows [R] the noise hash starts. Returns the chosen
    ids [R]."""
    vocab = x.shape[-1]
    ids = top_ids(x, min(max_k, vocab))
    return draw_among(x.gather(1, ids), ids, top_k, top_p, rows, vocab)


def draw_among(vals: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draw of `candidate_draw` from its candidates: ids [R, C] in the order of `order_key` (on CUDA from
    kernels/sampling.topk_candidates), vals [R, C] their values of x."""
    return _gumbel_pick(_mask_sorted(vals, top_k, top_p), ids, rows, vocab)


def full_sort_draw(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """The same draw over the whole sorted vocabulary (top_k = vocab: no top-k)."""
    vals, ids = x.sort(dim=-1, descending=True, stable=True)  # stable: ties in id order
    vals = _mask_sorted(vals, top_k, top_p)
    return _gumbel_pick(vals, ids, rows, x.shape[-1])
