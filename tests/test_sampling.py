"""The sampler's top-k / top-p draw over candidates against the full-vocabulary reference; sample seeds."""
import pytest
import torch

from tp_engine.sampling.sampler import SamplingParams, request_seed, sample, token_logprobs, uniform_noise
from tp_engine.sampling.topk_sampling import _mask_sorted, full_sort_draw, row_hash


def reference(logits, params, seeds, steps):
    """The sampler's former full-vocabulary path: sort every row, mask, Gumbel noise at every token id.
    Top-k keeps exactly k tokens, ties at the k-th value going to the lower ids (a stable sort)."""
    out = logits.argmax(dim=-1)
    dev = logits.device
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    x = logits[rows] / torch.tensor([params[i].temperature for i in rows], device=dev)[:, None]
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    k = torch.tensor([params[i].top_k or vocab for i in rows], device=dev)
    sorted_x = sorted_x.masked_fill(torch.arange(vocab, device=dev)[None, :] >= k[:, None], float("-inf"))
    top_p = torch.tensor([params[i].top_p for i in rows], device=dev)
    probs = sorted_x.softmax(-1)
    # the test below holds it to HF
    drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1)
    x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    u = uniform_noise(torch.tensor([seeds[i] for i in rows], device=dev),
                      torch.tensor([steps[i] for i in rows], device=dev), vocab)
    out[rows] = (x - torch.log(-torch.log(u))).argmax(dim=-1)
    return out


def random_rows(gen, n, vocab, device="cpu"):
    logits = torch.randn(n, vocab, generator=gen).to(device) * 3
    for r in range(0, n, 3):  # ties: values rounded to a coarse grid, as bf16 logits are
        logits[r] = (logits[r] * 2).round() / 2
    logits[1::7] = 0.0  # all tokens equal
    return logits


def mixed_params(n, vocab):
    choices_k = [1, 2, 5, 20, 64, vocab + 3]  # larger than the vocabulary too
    choices_p = [1.0, 0.95, 0.5, 1e-6]
    return [SamplingParams(temperature=[0.3, 0.7, 1.0, 2.5][i % 4], top_k=choices_k[i % 6],
                           top_p=choices_p[(i // 6) % 4]) for i in range(n)]


@pytest.mark.parametrize("vocab", [50, 1000])
def test_candidate_path_equals_full_vocabulary_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    n = 400
    logits = random_rows(gen, n, vocab)
    choices_p = [1.0, 0.95, 0.5, 1e-6]
    params = mixed_params(n, vocab)
    seeds = [request_seed(3, i, i % 3) for i in range(n)]
    steps = [i * 7 % 13 for i in range(n)]
    got = sample(logits, params, seeds, steps)
    want = reference(logits, params, seeds, steps)
    assert torch.equal(got, want), (got != want).nonzero()[:5]
    # top_k = 0 with top_p < 1 sorts the vocabulary, through the same masks
    nucleus = [SamplingParams(temperature=0.8, top_p=choices_p[i % 4]) for i in range(n)]
    assert torch.equal(sample(logits, nucleus, seeds, steps), reference(logits, nucleus, seeds, steps))


def test_a_rows_draw_does_not_depend_on_its_batch_mates():
    gen = torch.Generator().manual_seed(1)
    logits = random_rows(gen, 60, 300)
    params = [SamplingParams(temperature=1.0, top_k=[1, 3, 40, 0, 0][i % 5], top_p=[1.0, 0.9, 0.3][i % 3])
              for i in range(60)]
    seeds, steps = list(range(60)), [5] * 60
    together = sample(logits, params, seeds, steps)
    alone = torch.cat([sample(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], steps[i:i + 1])
                       for i in range(60)])
    assert torch.equal(together, alone)
    k1 = [i for i in range(60) if params[i].top_k == 1]
    assert torch.equal(together[k1], logits[k1].argmax(-1))  # k = 1 is greedy (ties: the lowest id)


def test_full_sort_draw_breaks_ties_by_token_id():
    x = torch.zeros(1, 8)
    x[0, [2, 5, 6]] = 1.0
    # top_k 2 of three tied tokens keeps ids 2 and 5; over many rows both appear and 6 never does
    rows = row_hash(torch.arange(400), torch.zeros(400, dtype=torch.int64))
    got = full_sort_draw(x.expand(400, -1) * 50, torch.full((400,), 2), torch.ones(400), rows)
    assert set(got.tolist()) == {2, 5}


def test_top_p_keeps_as_many_tokens_as_transformers():
    """top-p keeps the smallest set of most likely tokens whose mass reaches top_p: a token whose predecessors
    already hold top_p goes, also when their mass equals it exactly (equal logits: 0.5 + 0.5, 4 x 0.25)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    gen = torch.Generator().manual_seed(2)
    vocab, n = 64, 120
    x = random_rows(gen, n, vocab)
    x[0:3] = -30.0
    x[0:3, [9, 4]] = 5.0  # two equal tokens hold all the mass
    x[3:6] = -30.0
    x[3:6, [1, 8, 30, 2]] = 2.0  # four
    for top_p in (0.5, 0.25, 0.75, 0.9, 0.95):
        ours = _mask_sorted(x.sort(dim=-1, descending=True, stable=True).values, torch.full((n,), vocab),
                            torch.full((n,), top_p))
        hf = TopPLogitsWarper(top_p)(None, x.clone())
        assert torch.equal(torch.isfinite(ours).sum(-1), torch.isfinite(hf).sum(-1)), top_p
    # the draw keeps the lower id of the two equal tokens at top_p 0.5, on both top-p paths
    rows = row_hash(torch.arange(200), torch.zeros(200, dtype=torch.int64))
    two = x[:1].expand(200, -1)
    assert set(full_sort_draw(two, torch.full((200,), vocab), torch.full((200,), 0.5), rows).tolist()) == {4}
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=0.5) for k in (2, 0)]
    for p in params:
        assert {int(sample(x[:1], [p], [s], [0])) for s in range(100)} == {4}, p


def test_token_logprobs_rank_ties_as_the_draw_does():
    """Equal logits (common in bf16) are ranked by id, the lower first, as the sampler ranks them: the greedy
    token comes first and the top 3 are the first 3 of the top 7. K above the vocabulary gives the
    vocabulary."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (16, 3000), generator=gen).float()
    greedy = logits.argmax(-1)
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    _, ids7, vals7 = token_logprobs(logits, greedy, 7)
    _, ids3, _ = token_logprobs(logits, greedy, 3)
    assert torch.equal(ids7, order[:, :7]) and torch.equal(ids3, ids7[:, :3])
    assert torch.equal(ids7[:, 0], greedy)
    torch.testing.assert_close(vals7, torch.log_softmax(logits, -1).gather(1, order[:, :7]))
    chosen, ids, vals = token_logprobs(logits[:2, :5], greedy[:2] % 5, 20)
    assert ids.shape == (2, 5) and sorted(ids[0].tolist()) == list(range(5))


def test_sample_seeds_keep_sample_zero_and_differ_per_sample():
    assert request_seed(7, 3, 0) == 7 * 1_000_003 + 3  # n = 1 keeps the stream of earlier versions
    seeds = {request_seed(7, i, j) & 0xFFFFFFFF for i in range(50) for j in range(8)}
    assert len(seeds) == 400


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(3, 100)
    tokens = torch.tensor([4, 50, 99])
    chosen, ids, vals = token_logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(chosen.double(), ref[torch.arange(3), tokens], atol=1e-5, rtol=0)
    assert torch.equal(ids, ref.topk(5).indices)
    assert (vals[:, :-1] >= vals[:, 1:]).all()


def test_noise_at_the_top_hash_value_is_finite_and_masked_tokens_never_win():
    """One token in 2**24 hashes to the top 24-bit value, whose uniform must stay below 1.0: rounded to 1.0 it
    gives infinite noise, and a token outside top-k (NaN) or any token in a temperature-only row would win
    regardless of its logit."""
    vocab = 1 << 17
    for seed in range(400):
        u = uniform_noise(torch.tensor([seed]), torch.tensor([0]), vocab)
        if (u >= 1 - 2 ** -24).any():
            break
    else:
        raise AssertionError("no top hash value found")
    hit = int((u[0] >= 1 - 2 ** -24).nonzero()[0])
    assert torch.isfinite(torch.log(-torch.log(u))).all()
    logits = torch.zeros(1, vocab)
    logits[0, 7] = 40.0  # certain under any of the draws below
    logits[0, hit] = -40.0
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_k=5, top_p=0.5),
              SamplingParams(temperature=1.0)):
        assert sample(logits, [p], [seed], [0]).item() == 7, p


def test_a_tiny_temperature_is_greedy():
    """Temperatures far below any useful one draw the arg-max on every path (plain, few and many top-k
    candidates, top-p alone): at 1e-38, logits / temperature must not overflow to +inf and let the lowest id
    win."""
    gen = torch.Generator().manual_seed(5)
    vocab = 300
    logits = torch.randn(8, vocab, generator=gen) * 3 + 5  # mostly positive, so overflow would show
    for t in (1e-45, 1e-38, 1e-30, 1e-6):
        params = [SamplingParams(temperature=t, top_k=k, top_p=p)
                  for k, p in ((0, 1.0), (5, 1.0), (vocab + 1, 1.0), (0, 0.9))] * 2
        got = sample(logits, params, list(range(8)), [3] * 8)
        assert torch.equal(got, logits.argmax(dim=-1)), t


def test_extreme_temperature_and_top_p_keep_the_most_likely_tokens():
    """Both are checked as float64 but applied in fp32, where a top_p under 1e-45 is 0 (dropping every token)
    and a temperature over 3.4e38 is inf (every logit / temperature 0): a tiny top_p keeps the most likely
    token alone, and a huge temperature draws among the top k, not the lowest ids."""
    gen = torch.Generator().manual_seed(6)
    vocab = 300
    logits = torch.randn(8, vocab, generator=gen)
    logits[:, 250:253] += 20  # the three most likely tokens, far from id 0
    top3 = set(range(250, 253))
    for p in (1e-46, 1e-300):  # top_p alone, and with top_k (the candidate path)
        params = [SamplingParams(temperature=1.0, top_p=p, top_k=k) for k in (0, 5)] * 4
        assert torch.equal(sample(logits, params, list(range(8)), [3] * 8), logits.argmax(dim=-1)), p
    for t in (1e39, 1e300):
        params = [SamplingParams(temperature=t, top_k=k, top_p=p) for k, p in ((3, 1.0), (3, 0.9))] * 4
        got = [sample(logits, params, list(range(8)), [step] * 8).tolist() for step in range(20)]
        assert {tok for row in got for tok in row} == top3, t  # each of the three, and only they


def test_a_nan_logit_is_what_every_draw_picks_as_greedy_does():
    """A NaN logit (a model whose numbers blew up): every draw picks the first NaN, as torch.argmax does for
    greedy, whatever the NaN's sign bit, and never the id `vocab`, one past the vocabulary, which would be fed
    back as the next input."""
    from tp_engine.sampling.sampler import TOPK_MAX_K
    vocab = 2 * TOPK_MAX_K + 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[:, 40] = float("nan")
    logits[:, 7] = -torch.tensor(float("nan"))  # the sign bit set, as x86 makes NaNs
    logits[:, 3] = 30.0  # certain, but for the NaNs
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=0.7, top_k=TOPK_MAX_K + 10),
              SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.5)]
    for step in range(4):
        got = sample(logits, params, [11 * i for i in range(6)], [step] * 6)
        assert got.tolist() == [7] * 6, (step, got)
    chosen, _, _ = token_logprobs(logits, got, 3)
    assert chosen.isnan().all()
