"""Speculative sampling on rank 0: the draft's draws and the target's exact acceptance rule.

A proposer drafts tokens; the target scores them in one forward and `verify` keeps a prefix by rejection
sampling: a draft x drawn from q is accepted with probability min(1, p(x) / q(x)), and at the first rejection
the target draws from norm(max(0, p - q)) instead, so every appended token has the target's distribution p
exactly (p, q: the distributions `sample` draws from, after temperature, top-k and top-p). Greedy requests
accept a draft while it is the target's greedy token, so their output is greedy decoding's, token for token.

Every draw uses the sampler's counter-based noise (topk_sampling.row_hash / noise_at), a pure function of
(seed, output step, token id): a speculative run is reproducible and the same whatever the batch, the TP size
or the device. Each kind of draw salts the seed (`salted`), so the draft's proposal, the acceptance uniform
and the residual draw at a step are independent of one another and of the target's own draw at that step.
That own draw is the bonus token after all drafts are accepted, exactly as `sample` draws it, so such a
request goes on with the draws of a run without speculation.
"""
from __future__ import annotations

from itertools import accumulate

import torch

from tp_engine.kernels.sampling import TOPK_MAX_K
from tp_engine.sampling.sampler import GREEDY_BELOW, SamplingParams, group_inputs, sample, to_device
from tp_engine.sampling.topk_sampling import M32, _mask_sorted, hash32, noise_at, row_hash, top_ids

# The salts of the three draws, xor-ed into the seed before the sampler's hash (`salted`): the draft's
# proposal, the uniform that accepts or rejects a draft, and the Gumbel noise of the residual draw. The
# target's own draw (the greedy token, the bonus token) is `sample`'s, unsalted.
DRAFT_SALT = 0x5BD1E995
ACCEPT_SALT = 0x27D4EB2F
RESIDUAL_SALT = 0x165667B1


def salted(seeds: list[int], salt: int) -> list[int]:
    """The seeds of one kind of draw: hash32(seed ^ salt) of the seed's low 32 bits (all `row_hash` reads),
    a bijection of the seed for each salt."""
    return [hash32((s & M32) ^ salt) for s in seeds]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] logits -> [R, V] float32 probabilities of the distribution `sample()` draws from for each row's
    params (temperature, then top-k/top-p with the sampler's exact kept sets; zero outside). Rows of greedy
    params: a one-hot at the sampler's greedy token (argmax, lowest id among ties).

    The rows go in `sample`'s groups through its torch path (topk_sampling's candidates and `_mask_sorted`),
    so each row keeps the tokens `sample` keeps on the CPU."""
    x = logits.float()
    out = torch.zeros_like(x)
    dev, vocab = x.device, x.shape[-1]
    greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_BELOW]
    if greedy:
        rows_t = to_device(greedy, torch.int64, dev)
        out[rows_t, x[rows_t].argmax(dim=-1)] = 1.0
    rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    plain = [i for i in rows if params[i].top_k == 0 and params[i].top_p >= 1]
    few = [i for i in rows if 0 < params[i].top_k <= TOPK_MAX_K]
    many = [i for i in rows if params[i].top_k > TOPK_MAX_K]
    nucleus = [i for i in rows if params[i].top_k == 0 and params[i].top_p < 1]
    for group in (plain, few, many, nucleus):
        if not group:
            continue
        rows_t, temps, k, p = group_inputs(params, group, vocab, dev)
        xg = x[rows_t] / temps[:, None]
        if group is plain:
            out[rows_t] = xg.softmax(dim=-1)
            continue
        if group is nucleus:  # as topk_sampling.full_sort_draw
            vals, ids = xg.sort(dim=-1, descending=True, stable=True)
        else:  # as topk_sampling.candidate_draw
            ids = top_ids(xg, min(max(params[i].top_k for i in group), vocab))
            vals = xg.gather(1, ids)
        out[rows_t] = torch.zeros_like(xg).scatter_(1, ids, _mask_sorted(vals, k, p).softmax(dim=-1))
    return out


def draft_draw(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int],
               ops=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft model's proposal: for each row, a token drawn from filtered_probs(logits, params) with the
    request's seed at output step `steps[i]` (noise independent of the target's draw at that step: a distinct
    salt), and those probabilities q [R, V]. Greedy rows: the argmax (q one-hot); q is None when every row is
    greedy, since `verify` reads no greedy request's q.

    The draw is `sample`'s with the seeds salted by DRAFT_SALT (on CUDA through the engine's kernels
    `ops`)."""
    tokens = sample(logits, params, salted(seeds, DRAFT_SALT), steps, ops)
    sampled = any(p.temperature >= GREEDY_BELOW for p in params)
    return tokens, filtered_probs(logits, params) if sampled else None


def verify(logits: torch.Tensor, lens: list[int], drafts: list[list[int]], q: list[torch.Tensor | None],
           params: list[SamplingParams], seeds: list[int], steps: list[int], ops=None) -> list[list[int]]:
    """Rejection sampling of each request's drafts. logits: [sum(lens), V], request i's rows are its lens[i] =
    len(drafts[i]) + 1 consecutive rows (row j: the target's logits for the token after draft j, row 0 for
    the first draft). q[i]: [len(drafts[i]), V] the draft probabilities that proposed them, or None for a
    deterministic proposer (n-gram lookup: a point mass at the draft). steps[i]: the output index of the
    first draft. Returns per request the tokens to append: the accepted drafts, then one token drawn by the
    target (after the first rejection, from the residual norm(max(0, p - q)); after all are accepted, the
    bonus token from the last row, drawn exactly as `sampler.sample` draws that row at that step).

    A sampled row whose p or q is not finite (NaN logits) rejects its draft and appends `sample`'s draw there.
    The results come to the host in one copy."""
    _check(logits, lens, drafts, q, params, seeds, steps)
    starts = [0, *accumulate(lens)][:-1]  # each request's first row
    of_row = [i for i, n in enumerate(lens) for _ in range(n)]
    # the target's own draw at every row: the greedy token, or the bonus token at a request's last row
    own = sample(logits, [params[i] for i in of_row], [seeds[i] for i in of_row],
                 [steps[i] + j for i, n in enumerate(lens) for j in range(n)], ops)
    sampled = [i for i, d in enumerate(drafts) if d and params[i].temperature >= GREEDY_BELOW]
    decided = _reject(logits, starts, sampled, drafts, q, params, seeds, steps) if sampled else []
    host = torch.cat([own, *decided]).tolist()
    n = sum(len(drafts[i]) for i in sampled)
    own_h, accept_h, other_h = host[: len(own)], host[len(own): len(own) + n], host[len(own) + n:]
    first, at = {}, 0  # a sampled request's first draft in accept_h / other_h
    for i in sampled:
        first[i], at = at, at + len(drafts[i])
    out = []
    for i, ds in enumerate(drafts):
        rows = own_h[starts[i]: starts[i] + lens[i]]
        tokens = []
        for j, x in enumerate(ds):
            if i in first:
                ok, other = accept_h[first[i] + j], other_h[first[i] + j]
                other = own_h[-1 - other] if other < 0 else other
            else:  # greedy: a draft is kept while it is the greedy token
                ok, other = x == rows[j], rows[j]
            if not ok:
                tokens.append(other)
                break
            tokens.append(x)
        else:
            tokens.append(rows[-1])
        out.append(tokens)
    return out


def _reject(logits: torch.Tensor, starts: list[int], reqs: list[int], drafts: list[list[int]],
            q: list[torch.Tensor | None], params: list[SamplingParams], seeds: list[int],
            steps: list[int]) -> list[torch.Tensor]:
    """For each draft of the sampled requests `reqs`, in order: whether it is accepted (int64 0/1), and the
    token appended if it is not: the residual draw, or where p or q is not finite -1 - (its row of logits),
    for the caller to take `sample`'s draw there."""
    dev, vocab = logits.device, logits.shape[-1]
    rows = to_device([starts[i] + j for i in reqs for j in range(len(drafts[i]))], torch.int64, dev)
    p = filtered_probs(logits[rows], [params[i] for i in reqs for _ in drafts[i]])
    x = to_device([t for i in reqs for t in drafts[i]], torch.int64, dev)
    qs = torch.cat([q[i].to(dev, torch.float32) if q[i] is not None
                    else torch.zeros(len(drafts[i]), vocab, device=dev) for i in reqs])
    point = to_device([q[i] is None for i in reqs for _ in drafts[i]], torch.bool, dev)
    qs[point, x[point]] = 1.0  # a deterministic proposer: a point mass at its draft
    seeds_r = [seeds[i] for i in reqs for _ in drafts[i]]
    steps_r = to_device([steps[i] + j for i in reqs for j in range(len(drafts[i]))], torch.int64, dev)
    # accept x with probability min(1, p(x) / q(x)): u * q(x) < p(x), u uniform in (0, 1)
    u = noise_at(row_hash(to_device(salted(seeds_r, ACCEPT_SALT), torch.int64, dev), steps_r),
                 torch.zeros(len(seeds_r), 1, dtype=torch.int64, device=dev))[:, 0]
    px, qx = p.gather(1, x[:, None])[:, 0], qs.gather(1, x[:, None])[:, 0]
    finite = p.isfinite().all(dim=-1) & qs.isfinite().all(dim=-1)
    accept = (u * qx < px) & finite
    # the residual max(0, p - q); all zero only where p == q (a rejection there is rounding): p itself
    residual = (p - qs).clamp_(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    ids = torch.arange(vocab, device=dev, dtype=torch.int64)[None, :].expand(len(seeds_r), -1)
    noise = noise_at(row_hash(to_device(salted(seeds_r, RESIDUAL_SALT), torch.int64, dev), steps_r), ids)
    # Gumbel-max over log residual: zero-mass tokens are -inf, never drawn; ties go to the lowest id
    drawn = (residual.log() - torch.log(-torch.log(noise))).argmax(dim=-1)
    return [accept.to(torch.int64), torch.where(finite, drawn, -1 - rows)]


def _check(logits: torch.Tensor, lens: list[int], drafts: list[list[int]], q: list[torch.Tensor | None],
           params: list[SamplingParams], seeds: list[int], steps: list[int]) -> None:
    """One clear ValueError for inputs of `verify` that do not fit together."""
    sizes = {"lens": len(lens), "drafts": len(drafts), "q": len(q), "params": len(params),
             "seeds": len(seeds), "steps": len(steps)}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"verify: one entry per request in each list, got lengths {sizes}")
    if logits.dim() != 2 or logits.shape[0] != sum(lens):
        raise ValueError(f"verify: logits must be [sum(lens) = {sum(lens)}, vocab], got {list(logits.shape)}")
    vocab = logits.shape[1]
    for i, (n, ds, qi) in enumerate(zip(lens, drafts, q)):
        if n != len(ds) + 1:
            raise ValueError(f"verify: request {i} has {len(ds)} drafts, so lens[{i}] must be {len(ds) + 1}, "
                             f"got {n}")
        if any(not 0 <= t < vocab for t in ds):
            raise ValueError(f"verify: request {i} has a draft outside the vocabulary [0, {vocab}): {ds}")
        if qi is not None and tuple(qi.shape) != (len(ds), vocab):
            raise ValueError(f"verify: q[{i}] must be [{len(ds)}, {vocab}], got {list(qi.shape)}")
