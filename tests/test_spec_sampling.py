"""Speculative sampling (sampling/speculative.py): the appended tokens keep the target's distribution, greedy
requests decode exactly as without drafts, every draw is reproducible and per request, and filtered_probs is
the distribution the sampler draws from."""
import math

import pytest
import torch

from tp_engine.sampling.sampler import SamplingParams, request_seed, sample
from tp_engine.sampling.speculative import draft_draw, filtered_probs, verify

# One check of frequencies fails by chance with probability at most DELTA (see `assert_frequencies`): the
# file's 24 checks together at most 2.4e-8.
DELTA = 1e-9

TARGET = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3],
                       [0.0, 0.8, -0.4, 1.6, 0.2, 1.1, -1.0, 0.6],
                       [1.2, -0.3, 0.4, 0.9, 1.7, 0.1, 0.7, -0.8]])
DRAFT = torch.tensor([[2.3, 1.5, 2.0, -0.5, 0.0, 1.0, -1.0, 0.3],
                      [0.0, 1.6, -0.4, 0.8, 1.1, 0.2, 0.5, 0.6]])
# The deterministic proposer's drafts for TARGET's rows 0 and 1, by request: likely tokens and unlikely ones.
POINT = ([0, 0, 0, 0, 1, 6], [3, 3, 3, 3, 5, 6])


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on tensors this small, more only wait on each other (many times over when busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_frequencies(tokens: list[int], probs: torch.Tensor, what: str) -> None:
    """The tokens' frequencies fit `probs`. A token of probability 0 is never drawn. For the others, by
    Chernoff's bound P(count/n >= p + t) <= exp(-n KL(p + t || p)) (and the same below p), so with a union
    over the tokens' two sides a correct draw fails only if n KL > log(2 V / DELTA), with probability at most
    DELTA. At the n used here a shift of 0.03 to 0.08 in one token's probability fails it."""
    n, probs = len(tokens), probs.double().tolist()
    assert n > 1000, f"{what}: only {n} draws"
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()
    bound = math.log(2 * len(probs) / DELTA)
    for t, (c, p) in enumerate(zip(counts, probs)):
        if p == 0:
            assert c == 0, f"{what}: token {t} of probability 0 drawn {c} times"
            continue
        f = c / n
        kl = sum(a * math.log(a / b) for a, b in ((f, p), (1 - f, 1 - p)) if a > 0)
        assert n * kl <= bound, f"{what}: token {t} drawn {f:.4f} of {n} times, probability {p:.4f}"


def reference_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The filtered distribution from a stable sort of each row: top-k keeps the k highest (the lower id first
    among equal values), top-p the smallest prefix whose mass reaches top_p; greedy: one-hot at the argmax."""
    out = torch.zeros_like(logits)
    for i, p in enumerate(params):
        if p.temperature < 1e-5:
            out[i, logits[i].argmax()] = 1.0
            continue
        vals, ids = (logits[i] / p.temperature).sort(descending=True, stable=True)
        vals[p.top_k or len(vals):] = float("-inf")
        probs = vals.softmax(-1)
        if p.top_p < 1:
            vals[probs.cumsum(-1) - probs >= p.top_p] = float("-inf")
        out[i, ids] = vals.softmax(-1)
    return out


def speculate(params: SamplingParams, n: int, point: bool) -> list[list[int]]:
    """n requests of two drafts each over TARGET's three rows: drafted by draft_draw from DRAFT (q), or with
    point=True from POINT (q None), inside and outside the target's kept set."""
    vocab = TARGET.shape[1]
    seeds = [request_seed(11, i) for i in range(n)]
    steps = [3 + i % 5 for i in range(n)]
    if point:
        drafts = [[POINT[0][i % 6], POINT[1][i // 6 % 6]] for i in range(n)]
        q = [None] * n
    else:
        rows = DRAFT.repeat(n, 1)  # request i's rows 2i, 2i + 1
        tokens, probs = draft_draw(rows, [params] * 2 * n, [s for s in seeds for _ in (0, 1)],
                                   [s + j for s in steps for j in (0, 1)])
        drafts = tokens.view(n, 2).tolist()
        q = list(probs.view(n, 2, vocab))
    return verify(TARGET.repeat(n, 1), [3] * n, drafts, q, [params] * n, seeds, steps)


@pytest.mark.parametrize("point", [False, True], ids=["draft-q", "point-mass"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.7),
                                    SamplingParams(temperature=1.0, top_k=6, top_p=0.85)],
                         ids=["plain", "top-k", "top-p", "top-k-p"])
def test_appended_tokens_follow_the_target(params, point):
    """Each appended position has the target's filtered distribution of its row: the first token (accepted
    draft or residual draw), the second given the first draft was accepted (at an independent step, so the
    condition changes nothing), and the third (the bonus) given both were."""
    out = speculate(params, 20000 if point else 12000, point)  # point: fewer accepted
    p = reference_probs(TARGET, [params] * 3)
    assert all(1 <= len(o) <= 3 for o in out)
    for j in range(3):
        assert_frequencies([o[j] for o in out if len(o) > j], p[j], f"position {j}")


def greedy_logits(vocab: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, vocab, generator=gen)
    logits[1, [3, 7, 12]] = logits[1].max() + 1  # a tie at the top: id 3 is the greedy token
    logits[3] = 0.5  # all equal: id 0
    return logits


def reference_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Greedy decoding: the highest logit, the lowest id among equal ones; drafts kept while they match."""
    best = [max(range(logits.shape[1]), key=lambda t: (row[t].item(), -t)) for row in logits]
    out = []
    for j, x in enumerate(drafts):
        out.append(best[j])
        if x != best[j]:
            return out
    return out + [best[len(drafts)]]


def test_greedy_equals_greedy_decoding():
    """Greedy requests (temperature 0 and below GREEDY_BELOW) append what greedy decoding gives, whether the
    drafts all match, miss at any one position, or name a tied token other than the lowest id; a draft's q
    changes nothing."""
    logits = greedy_logits()
    greedy = sample(logits, [SamplingParams()] * 5, [0] * 5, [0] * 5).tolist()
    assert greedy[1] == 3 and greedy[3] == 0
    cases = [greedy[:4]]  # every draft matches: the bonus from the last row
    for m in range(4):
        cases.append(greedy[:m] + [(greedy[m] + 1) % 16] + greedy[m + 1: 4])
    cases += [greedy[:1] + [7, 0, 0], greedy[:3] + [5], greedy[:2], []]  # 7: tied with 3, a higher id
    n = len(cases)
    rows = torch.cat([logits[: len(d) + 1] for d in cases])
    params = [SamplingParams(temperature=0.0 if i % 2 else 1e-6) for i in range(n)]
    q = [torch.full((len(d), 16), 1 / 16) if i % 3 == 0 else None for i, d in enumerate(cases)]
    out = verify(rows, [len(d) + 1 for d in cases], cases, q, params, list(range(n)), [0] * n)
    for d, got in zip(cases, out):
        assert got == reference_greedy(logits, d), d
    assert out[0] == greedy and out[1] == [greedy[0]]


def mixed_batch(n: int = 40, vocab: int = 10):
    """n requests of 0 to 3 drafts with mixed params, q from a draft model or None."""
    gen = torch.Generator().manual_seed(2)
    lens = [1 + i % 4 for i in range(n)]
    logits = torch.randn(sum(lens), vocab, generator=gen) * 2
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_k=[0, 3, 0, 6][i % 3],
                             top_p=[1.0, 0.8][i % 2]) for i in range(n)]
    seeds, steps = [request_seed(4, i) for i in range(n)], [i * 7 % 11 for i in range(n)]
    draft_logits = torch.randn(sum(lens), vocab, generator=gen) * 2
    drafts, q, at = [], [], 0
    for i, n_rows in enumerate(lens):
        k = n_rows - 1
        tokens, probs = draft_draw(draft_logits[at: at + k], [params[i]] * k, [seeds[i]] * k,
                                   [steps[i] + j for j in range(k)])
        drafts.append(tokens.tolist())
        q.append(probs if i % 5 else None)
        at += n_rows
    return logits, lens, drafts, q, params, seeds, steps


def test_reproducible_and_independent_of_the_batch():
    """The same inputs give the same tokens; each request gets the same tokens alone as in the batch, and in
    a batch of the other order."""
    logits, lens, drafts, q, params, seeds, steps = batch = mixed_batch()
    out = verify(*batch)
    assert out == verify(*batch)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for i in range(len(lens)):
        alone = verify(logits[starts[i]: starts[i] + lens[i]], [lens[i]], [drafts[i]], [q[i]], [params[i]],
                       [seeds[i]], [steps[i]])
        assert alone == [out[i]], i
    order = list(reversed(range(len(lens))))
    rows = torch.cat([logits[starts[i]: starts[i] + lens[i]] for i in order])
    back = verify(rows, *[[x[i] for i in order] for x in (lens, drafts, q, params, seeds, steps)])
    assert back == [out[i] for i in order]
    assert len({len(o) for o in out}) > 1  # some drafts were rejected, some accepted


def test_bonus_token_is_the_samplers_draw():
    """When the draft distribution is the target's, every draft is accepted and the token after them is
    sample()'s draw of the last row at its step: the stream without speculation."""
    logits, lens, _, _, params, seeds, steps = mixed_batch()
    starts = [sum(lens[:i]) for i in range(len(lens))]
    drafts, q = [], []
    for i, n in enumerate(lens):
        rows = logits[starts[i]: starts[i] + n - 1]
        tokens, probs = draft_draw(rows, [params[i]] * (n - 1), [seeds[i]] * (n - 1),
                                   [steps[i] + j for j in range(n - 1)])
        drafts.append(tokens.tolist())
        q.append(probs)
    out = verify(logits, lens, drafts, q, params, seeds, steps)
    last = logits[[s + n - 1 for s, n in zip(starts, lens)]]
    bonus = sample(last, params, seeds, [s + n - 1 for s, n in zip(steps, lens)]).tolist()
    assert out == [d + [b] for d, b in zip(drafts, bonus)]


def test_draft_noise_is_not_the_targets():
    """draft_draw at a (seed, step) draws from q with noise of its own: over uniform logits it picks the
    token sample() picks at that (seed, step) about 1 time in V, not always (bounds: ~7 standard
    deviations)."""
    n, vocab = 2000, 8
    logits = torch.zeros(n, vocab)
    params = [SamplingParams(temperature=1.0)] * n
    seeds, steps = [request_seed(9, i) for i in range(n)], [i % 7 for i in range(n)]
    tokens, q = draft_draw(logits, params, seeds, steps)
    same = (tokens == sample(logits, params, seeds, steps)).sum().item()
    assert 150 < same < 350, same
    assert torch.allclose(q, torch.full((n, vocab), 1 / vocab))


def test_rows_that_are_not_finite_take_the_samplers_draw():
    """A sampled row whose logits hold a NaN rejects its draft and appends sample()'s draw there (the NaN's
    id, as without speculation); rows before it still accept."""
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0], [0.0, 1.0, float("nan"), 0.0], [1.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0)]
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    want = sample(logits[1:2], params, [5], [1]).item()
    assert want == 2
    for qi in (q, None):
        assert verify(logits, [3], [[2, 1]], [qi], params, [5], [0]) == [[2, want]]


def test_filtered_probs_is_the_samplers_distribution():
    """filtered_probs sums to 1, equals the sorted reference, and sample() over many seeds never draws a token
    it gives probability 0; for rows with ties at the top-k and top-p boundaries, and greedy rows."""
    gen = torch.Generator().manual_seed(3)
    n, vocab, draws = 96, 12, 200
    logits = torch.randn(n, vocab, generator=gen) * 2
    logits[::2] = (logits[::2] * 2).round() / 2  # ties
    logits[5::8] = 1.0  # all equal
    params = [SamplingParams(temperature=[0.0, 0.5, 1.0, 2.0][i % 4], top_k=[0, 1, 2, 3, 5, 20][i % 6],
                             top_p=[1.0, 0.9, 0.5, 1e-6][(i // 6) % 4]) for i in range(n)]
    probs = filtered_probs(logits, params)
    assert torch.allclose(probs.sum(-1), torch.ones(n))
    assert torch.allclose(probs, reference_probs(logits, params), atol=1e-6)
    assert ((probs == 0).sum(-1) > 0).sum() > n // 2  # most rows drop tokens
    rows = torch.arange(n).repeat_interleave(draws)
    drawn = sample(logits[rows], [params[r] for r in rows.tolist()], list(range(n * draws)),
                   [7] * (n * draws))
    assert (probs[rows, drawn] > 0).all(), rows[probs[rows, drawn] == 0][:5]


def test_verify_refuses_inputs_that_do_not_fit():
    """Inputs that do not fit together get one ValueError naming the request and what is wrong."""
    logits, params = torch.zeros(3, 8), [SamplingParams(temperature=1.0)]
    with pytest.raises(ValueError, match=r"request 0 has 1 drafts, so lens\[0\] must be 2"):
        verify(logits, [3], [[1]], [None], params, [0], [0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify(logits, [3], [[1, 8]], [None], params, [0], [0])
    with pytest.raises(ValueError, match=r"q\[0\] must be \[2, 8\]"):
        verify(logits, [3], [[1, 2]], [torch.zeros(1, 8)], params, [0], [0])
    with pytest.raises(ValueError, match="logits must be"):
        verify(logits, [2], [[1]], [None], params, [0], [0])
