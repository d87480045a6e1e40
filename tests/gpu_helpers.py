"""Shared by the GPU tests: the engine on a checkpoint, greedy tokens, a model with peaked logits, and the
parity rule against transformers (equal tokens, or a near tie in the fp32 reference where they part)."""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda", 0) if HAS_CUDA else None
BF16 = torch.bfloat16

# Two logits are a near tie when they differ by less than this share of the larger (at least 0.1): bf16
# holds 8 bits of mantissa, so logits of 20 are rounded to 1/8, and sums in another order move them as much.
NEAR_TIE_REL, NEAR_TIE_ABS = 0.02, 0.1
LEADING_SHARE = 0.9  # of all greedy tokens, at least this many must come before the first difference

# The token sequences `memorize` teaches a model; prompts are their first 16 tokens.
SEQUENCES = torch.randint(2, 2048, (16, 48), generator=torch.Generator().manual_seed(0))
PARITY_PROMPTS = [s[:16].tolist() for s in SEQUENCES[:8]]


def needs_flashinfer() -> None:
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")


def memorize(model, path, steps: int = 80) -> str:
    """Train `model` (a transformers causal LM over a vocabulary of 2048) on SEQUENCES until it has them by
    heart, then save it in bf16 at `path`. Its logits on those sequences are peaked, as a trained model's
    are: the greedy margins stand far above bf16 rounding, unlike those of a random model, whose top two
    logits are often within rounding of each other."""
    torch.manual_seed(0)
    model.to(DEV).train()
    data = SEQUENCES.to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(steps):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert loss.item() < 0.05, f"the test model did not learn its sequences (loss {loss.item():.3f})"
    model.eval().to(BF16).save_pretrained(path)
    return str(path)


def tiny_memorized(path, layers: int = 2) -> str:
    """A `layers`-layer Qwen3 (4 query heads, 2 KV heads, head_dim 128) that knows SEQUENCES; bf16, at
    `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return memorize(Qwen3ForCausalLM(cfg), path)


def llm(ckpt: str, **options):
    from tp_engine.llm import LLM
    opts = dict(kv_cache={"num_pages": 256}, max_batch_size=8, cuda_graph_max_batch=8, seed=0)
    opts.update(options)
    return LLM(model=ckpt, **opts)


def generate(engine_llm, prompts, **sampling) -> list[list[int]]:
    from tp_engine.sampling.sampler import SamplingParams
    params = SamplingParams(**{"max_new_tokens": 12, "ignore_eos": True, **sampling})
    return [o["output_token_ids"] for o in engine_llm.generate([{"input_ids": p} for p in prompts], params)]


def hf_greedy(model, prompts, new_tokens: int) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([prompt], device=DEV), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=DEV)).logits[0].float()


def check_against(ref, prompt: list[int], ours: list[int], theirs: list[int]) -> int:
    """Tokens equal up to the first difference, which must be a near tie in the fp32 reference's logits
    (`ref`: transformers in fp32 on the same checkpoint). Returns how many leading tokens are equal."""
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            logits = hf_logits(ref, prompt + ours[:j])[-1]
            gap = abs(logits[a] - logits[b]).item()
            bound = max(NEAR_TIE_ABS, NEAR_TIE_REL * max(abs(logits[a].item()), abs(logits[b].item())))
            assert gap < bound, \
                f"token {j}: {a} vs {b}, fp32 logits differ by {gap:.3f} (no near tie: >= {bound:.3f})"
            return j
    return len(ours)


def assert_follows(ours, theirs, what: str) -> None:
    """Most tokens of `ours` come before the first difference from `theirs`, prompt by prompt (a quantized
    model against its bf16 original on a peaked model: rounding moves only rare near ties)."""
    leading = sum(next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                  for x, y in zip(ours, theirs))
    total = sum(len(y) for y in theirs)
    assert leading >= LEADING_SHARE * total, f"{what} for only {leading} of {total} tokens"


def assert_parity(ref, prompts, ours, theirs) -> None:
    """Every difference at a near tie, and most tokens before the first difference of their prompt."""
    matched = sum(check_against(ref, p, a, b) for p, a, b in zip(prompts, ours, theirs))
    total = sum(len(a) for a in ours)
    assert matched >= LEADING_SHARE * total, \
        f"only {matched} of {total} greedy tokens before the first difference"


def step_batch(prefill: bool, seq_lens, extend_lens, tables, page_size, dev):
    """A context.Batch for attention-backend tests: request i holds seq_lens[i] tokens in pages tables[i], the
    last extend_lens[i] of them computed in this step."""
    from tp_engine.base.batch import Batch
    pos, loc = [], []
    for L, n, t in zip(seq_lens, extend_lens, tables):
        for p in range(L - n, L):
            pos.append(p)
            loc.append(t[p // page_size] * page_size + p % page_size)
    N = len(pos)
    last = torch.tensor(extend_lens).cumsum(0) - 1
    return Batch(prefill, torch.zeros(N, dtype=torch.int64, device=dev), torch.tensor(pos, device=dev),
                 torch.tensor(loc, device=dev), list(seq_lens), list(extend_lens), [list(t) for t in tables],
                 last.to(dev))


def paged_attention_reference(q, cache, pages: list[list[int]], lens: list[int]) -> torch.Tensor:
    """softmax(q k / sqrt(d)) v in float64 of each request's one-token query q [B, heads, d] over its first
    lens[r] tokens in pages[r] of a layer cache [pages, 2, page_size, kv_heads, d] (grouped query heads)."""
    import math
    b, h, d = q.shape
    kvh = cache.shape[3]
    out = torch.empty(b, h, d, dtype=torch.float64, device=q.device)
    for r, (p, n) in enumerate(zip(pages, lens)):
        idx = torch.tensor(p, device=q.device, dtype=torch.int64)
        k = cache[idx, 0].reshape(-1, kvh, d)[:n].double()
        v = cache[idx, 1].reshape(-1, kvh, d)[:n].double()
        w = (torch.einsum("hgd,thd->hgt", q[r].double().view(kvh, h // kvh, d), k) / math.sqrt(d)).softmax(-1)
        out[r] = torch.einsum("hgt,thd->hgd", w, v).reshape(h, d)
    return out
