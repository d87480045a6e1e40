"""Token selection on rank 0: greedy, temperature, top-k, top-p.

Random draws come from a counter-based hash of (seed, request index, output step, token id), not from a
stateful generator, so a request's samples do not depend on which other requests share its batch, on
preemption, on the TP size or on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tp_engine.base.sampling_keys import check_sampling
from tp_engine.kernels.sampling import TOPK_MAX_K
from tp_engine.sampling.topk_sampling import (M32, candidate_draw, full_sort_draw, hash32, noise_at, row_hash,
                                              top_ids)


@dataclass
class SamplingParams:
    """The `sampling` keys of the config, and `seed`; checked by the same rules as the config
    (config.SCHEMA), with the same messages. `stop` may be one string."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int = 0
    # output constraints (sampling/constraints.py), at most one
    json_schema: dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    seed: int | None = None  # None: the LLM's (the config's) seed

    def __post_init__(self) -> None:
        self.validate()  # `stop` as one string becomes a list of one, not one stop per character

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) for a value the config would refuse; generate() calls it again on
        every rank, since the fields may have been changed after construction."""
        values = check_sampling({f.name: getattr(self, f.name) for f in fields(self)}, "SamplingParams.")
        for name, value in values.items():
            setattr(self, name, value)


def request_seed(seed: int, index: int, sample: int = 0) -> int:
    """The seed of sample `sample` of prompt `index`. Sample 0 keeps the stream of a run without `n`; sample
    j > 0 mixes j in with the counter hash (in Python ints: called per request per step), so it depends on
    (seed, index, j) only, never on n."""
    base = seed * 1_000_003 + index
    if sample == 0:
        return base
    return hash32(hash32(base & M32) ^ hash32(sample * 0x9E3779B1 & M32))  # on Python ints as on tensors


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (seed, step, token id) per row."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return noise_at(row_hash(seeds, steps), ids[None, :].expand(seeds.shape[0], -1))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`; on CUDA through pinned memory, so the host does not wait."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


# Temperatures below this are greedy: the draw is the arg-max there but for logits closer than about 1e-5, and
# logits / temperature overflows fp32 near 1e-38 (every large logit +inf: the lowest such id would win).
GREEDY_BELOW = 1e-5
# Above this, logits / temperature would underflow fp32 to zeros (top-k would keep the lowest ids); at it the
# distribution is already uniform to fp32's precision. A top_p below TOP_P_MIN, 0 in fp32, would drop even the
# most likely token; at TOP_P_MIN it keeps that one alone, as any top_p below its probability does.
TEMPERATURE_MAX, TOP_P_MIN = 1e30, 1e-30


def group_inputs(params: list[SamplingParams], rows: list[int], vocab: int,
                 dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' indices, temperatures, top_k (the vocabulary for none) and top_p on `dev`, in two copies
    (one of ints, one of floats), each a contiguous [R] tensor."""
    ints = to_device([rows, [min(params[i].top_k, vocab) or vocab for i in rows]], torch.int64, dev)
    floats = to_device([[min(params[i].temperature, TEMPERATURE_MAX) for i in rows],
                        [max(params[i].top_p, TOP_P_MIN) for i in rows]], torch.float32, dev)
    return ints[0], floats[0], ints[1], floats[1]


def _row_hashes(seeds: list[int], steps: list[int], rows: list[int], dev: torch.device) -> torch.Tensor:
    both = to_device([[seeds[i] for i in rows], [steps[i] for i in rows]], torch.int64, dev)
    return row_hash(both[0], both[1])


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int],
           ops=None) -> torch.Tensor:
    """logits: [B, vocab] -> chosen ids [B] (int64). Each row's draw depends on its own values only. Logits in
    bf16 or fp16 (the CUDA graphs') are drawn from as their fp32 values, which hold them exactly. ops: the
    engine's fused kernels (kernels.select) or None: the same draws, in fewer passes over the logits."""
    ops = _kernels(logits, ops)
    if ops is None:
        logits = logits.float()
    rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if len(rows) < len(params) or ops is None:  # the greedy rows' tokens (on CUDA every row's, in one launch)
        chosen = ops.argmax(logits) if ops is not None else logits.argmax(dim=-1)
    else:  # every row draws
        chosen = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    if not rows:
        return chosen
    dev, vocab = logits.device, logits.shape[-1]
    plain = [i for i in rows if params[i].top_k == 0 and params[i].top_p >= 1]
    # candidates from one kernel on CUDA
    few = [i for i in rows if 0 < params[i].top_k <= TOPK_MAX_K]
    many = [i for i in rows if params[i].top_k > TOPK_MAX_K]
    nucleus = [i for i in rows if params[i].top_k == 0 and params[i].top_p < 1]
    for group in (plain, few, many, nucleus):
        if not group:
            continue
        rows_t, temps, k, p = group_inputs(params, group, vocab, dev)
        hashes = _row_hashes(seeds, steps, group, dev)
        max_k = min(max(params[i].top_k for i in group), vocab)
        if group is plain:
            drawn = _plain_draw(logits, rows_t, temps, hashes, ops)
        elif ops is not None and group is few:
            ids = ops.topk_candidates(logits, rows_t, temps, max_k)
            drawn = ops.draw_among(logits, rows_t, temps, ids, k, p, hashes)
        elif group is nucleus:  # top_p alone bounds no candidate count: sort the vocabulary
            drawn = full_sort_draw(logits[rows_t].float() / temps[:, None], k, p, hashes)
        else:  # a few candidates per row, no sort of the vocabulary
            drawn = candidate_draw(logits[rows_t].float() / temps[:, None], k, p, hashes, max_k)
        if len(group) == len(params):  # every row, in order
            return drawn
        chosen[rows_t] = drawn
    return chosen


def _kernels(logits: torch.Tensor, ops):
    """The fused kernels `ops` (kernels/sampling.py) when `logits` suits them, else None."""
    if ops is None or not logits.is_floating_point() or logits.stride(-1) != 1:
        return None
    return ops


def _plain_draw(logits: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor, hashes: torch.Tensor,
                ops=None) -> torch.Tensor:
    """Temperature only: Gumbel-max over the whole vocabulary (one fused pass on CUDA)."""
    if ops is not None:  # the same draw in one pass over the logits (kernels/sampling.py)
        return ops.gumbel_argmax(logits, rows, temps, hashes)
    x = logits[rows] / temps[:, None]
    ids = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)[None, :].expand(len(rows), -1)
    # Gumbel-max: a draw from softmax(x)
    return (x - torch.log(-torch.log(noise_at(hashes, ids)))).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int,
                   ops=None) -> tuple[torch.Tensor, ...]:
    """From logits [B, vocab] (before temperature and filters; taken in fp32): the chosen tokens'
    log-probabilities [B], and the k most likely tokens' ids and log-probabilities [B, k], most likely
    first. No sort of the vocabulary. ops: as `sample`'s."""
    logits = logits.float()
    lp = torch.log_softmax(logits, dim=-1)
    k = min(k, lp.shape[-1])
    # ranked as the draws rank the logits (value descending, the lower id first among equal values), so the
    # greedy token comes first and the top k are the first k of the top k + 1 (torch.topk orders ties anyhow)
    ops = _kernels(logits, ops) if k <= TOPK_MAX_K else None
    if ops is not None:
        rows = torch.arange(lp.shape[0], device=lp.device)
        ids = ops.topk_candidates(logits, rows, torch.ones(lp.shape[0], device=lp.device), k)
    else:
        ids = top_ids(logits, k)
    return lp.gather(1, tokens[:, None]).squeeze(1), ids, lp.gather(1, ids)


def compile_draws(vocab: int, device: torch.device, ops) -> None:
    """Run the fused draws once on zero logits of the model's vocabulary: greedy, temperature alone and
    Qwen3's recommended top_k 20 / top_p 0.95, on bf16 logits (the graphs') and fp32 ones (eager steps'),
    and an output constraint's mask. Their kernels, specialized on the vocabulary's size, so compile at
    start-up (a second or so each) rather than inside a first run; a top_k of another power of two compiles
    at its first use."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.95)]
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.zeros(len(params), vocab, dtype=dtype, device=device)
        sample(logits, params, [0] * len(params), [0] * len(params), ops)
    masks = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32, device=device)
    ops.mask_logits(logits, masks, torch.tensor([-1, 0, 0], dtype=torch.int32, device=device))
    torch.cuda.synchronize(device)
