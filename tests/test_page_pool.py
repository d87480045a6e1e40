"""Pages on rank 0 (reference counts, the prefix cache and its LRU eviction), the scheduler's chunks and
shared pages driven by a stand-in model that reads its context back through the KV slots and page tables,
and the step message: only what changed, the same tables on every rank."""
import numpy as np
import pytest
import torch

from tp_engine.attention.kv_cache import page_table
from tp_engine.runtime.page_pool import ROOT_KEY, PagePool, page_key
from tp_engine.sampling.sampler import SamplingParams
from tp_engine.runtime.request import RequestOutput
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.step_message import PageTables, decode_message
from tp_engine.runtime.step_plan import step_message

V, EOS, S = 61, 7, 4
CPU = torch.device("cpu")


def keys_of(tokens: list[int]) -> list[bytes]:
    out, key = [], ROOT_KEY
    for i in range(len(tokens) // S):
        key = page_key(key, tokens[i * S:(i + 1) * S])
        out.append(key)
    return out


def test_refcounts_lru_eviction_and_no_page_freed_while_referenced():
    pool = PagePool(4, S)
    a, b = pool.alloc(2), pool.alloc(1)
    assert a == [0, 1] and b == [2]
    ka, kb = keys_of(list(range(8))), keys_of([9, 9, 9, 9])
    pool.register(a[0], ka[0])
    pool.register(a[1], ka[1])
    pool.register(b[0], kb[0])
    got = pool.match(keys_of(list(range(8)) + [1])[:2])  # a second holder of both pages
    assert got == a and pool.refs[:3] == [2, 2, 1]
    pool.release(a)
    assert pool.num_free == 1  # still referenced once: not free, not evictable
    assert pool.alloc(1) == [3]
    assert pool.num_free == 0
    pool.release(b)  # cached, unreferenced: b is the least recently used
    pool.release(got)
    assert pool.refs == [0, 0, 0, 1] and pool.num_free == 3
    assert pool.alloc(1) == [2]  # evicts b first, then a's pages in the order they were released
    assert pool.match(keys_of([9, 9, 9, 9, 1])[:1]) == []  # b's content is gone with its page
    assert pool.match(keys_of(list(range(8)))[:2]) == [0, 1]  # a's is still found
    pool.release([0, 1, 2, 3])
    assert not any(pool.refs) and pool.num_free == 4
    with pytest.raises(AssertionError, match="released more often"):
        pool.release([2])


def test_keys_chain_each_page_to_its_prefix():
    """A page's content at another position, after another prefix, is not a hit."""
    pool = PagePool(8, S)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    pages = pool.alloc(3)
    for p, k in zip(pages, keys_of(a + b + c)):
        pool.register(p, k)
    assert pool.match(keys_of(a + c + [0])[:2]) == pages[:1]
    assert pool.match(keys_of(b + [0])[:1]) == []
    assert pool.match(keys_of(a + b + c + [0])[:3]) == pages


def test_disabled_cache_never_hits():
    pool = PagePool(4, S, prefix_cache=False)
    p = pool.alloc(1)
    pool.register(p[0], keys_of([1, 2, 3, 4])[0])
    assert pool.match(keys_of([1, 2, 3, 4, 5])[:1]) == []
    pool.release(p)
    assert pool.free == [3, 2, 1, 0] and not pool.key_of


def issue(sched: Scheduler, plan) -> torch.Tensor:
    """What Engine.issue does on the host: the plan's message, and the step counted as issued."""
    msg = step_message(plan, sched.page_size).encode()
    sched.commit(plan)
    return msg


def model(context: list[int]) -> int:
    """A stand-in model whose next token depends on every token of its context and on their order."""
    return (sum((j + 1) * t for j, t in enumerate(context)) * 31 + len(context)) % V


def alone(prompt: list[int], max_new: int, ignore_eos: bool) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        t = model(seq)
        out.append(t)
        seq.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


PREFIX = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
PROMPTS = [PREFIX + [10, 11], PREFIX + [10, 11], PREFIX, PREFIX[:9], [20, 21, 22] * 7,
           PREFIX + [30] * 9, [40]]


def drive(num_pages: int, max_prefill: int, cache: bool, max_batch: int = 8, pool: PagePool | None = None):
    """Run PROMPTS through the scheduler with one step in flight, as the engine does; each step writes its
    input tokens into a stand-in KV store at the message's slots and every row reads its whole context back
    through the page table every rank builds from the messages."""
    pool = pool or PagePool(num_pages, S, cache)
    sched = Scheduler(pool, max_batch, max_prefill, num_pages * S, (EOS,))
    tables = PageTables()
    reqs = [RequestOutput(i, p, SamplingParams(max_new_tokens=5 + 2 * i, ignore_eos=i % 2 == 0))
            for i, p in enumerate(PROMPTS)]
    for r in reqs:
        sched.add(r)
    kv = np.full((num_pages + 1) * S, -1, dtype=np.int64)
    last = [0] * max_batch
    inflight, sizes, states = None, [], {}
    while sched.has_work():
        plan = sched.schedule()
        states.update((id(r), r) for r in plan.reqs)
        issued = None
        if plan.reqs:
            msg = issue(sched, plan)
            sizes.append((msg.numel(), plan))
            batch = decode_message(msg, tables)
            for r, t in zip(plan.reqs, batch.page_tables):  # the tables every rank holds are rank 0's
                assert t.tolist() == r.pages
            ids = [t if t >= 0 else last[-1 - t] for t in batch.input_ids.tolist()]
            kv[batch.out_loc.numpy()] = ids
            indptr, pages, _ = page_table(batch, S)
            tokens = []
            for i, L in enumerate(batch.seq_lens):
                own = pages[indptr[i]:indptr[i + 1]]
                tokens.append(model([int(kv[own[p // S] * S + p % S]) for p in range(L)]))
            last[:len(tokens)] = tokens
            issued = (plan, tokens)
        assert issued is not None or inflight is not None
        if inflight is not None:
            sched.update(*inflight)
        inflight = issued
    if inflight is not None:
        sched.update(*inflight)
    assert len(states) == len(reqs) and all(r.pending == 0 and not r.pages for r in states.values())
    assert pool.num_free == num_pages and not any(pool.refs)  # every reference returned
    return reqs, sched, sizes


@pytest.mark.parametrize("num_pages,max_prefill", [(64, 64), (64, 5), (12, 64), (12, 6)])
@pytest.mark.parametrize("cache", [True, False])
def test_shared_pages_and_chunks_read_the_right_context(num_pages, max_prefill, cache):
    reqs, sched, sizes = drive(num_pages, max_prefill, cache)
    for r in reqs:
        assert r.output_ids == alone(r.prompt_ids, r.params.max_new_tokens, r.params.ignore_eos), r.index
    hits = sum(r.cached_prompt_tokens for r in reqs)
    assert (hits > 0) == cache
    assert all(sum(plan.lens) <= max_prefill for _, plan in sizes)
    if num_pages == 12:
        assert sched.num_preempted > 0
    if max_prefill < 10:
        assert any(not all(plan.sampled) for _, plan in sizes)  # prompts were split


def test_same_step_requests_share_pages_and_last_page_is_private():
    pool = PagePool(32, S)
    sched = Scheduler(pool, 8, 64, 128, ())
    a, b, c = (sched.add(RequestOutput(i, p, SamplingParams(max_new_tokens=3))) for i, p in
               enumerate([PREFIX + [10], PREFIX, PREFIX + [10]]))
    plan = sched.schedule()
    assert plan.reqs == [a, b, c]
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]  # b's last token lives in its own page
    assert c.pages[:3] == a.pages[:3] and c.pages[3] != a.pages[3]
    assert plan.lens == [13, 4, 1] and [b.out.cached_prompt_tokens, c.out.cached_prompt_tokens] == [8, 12]
    assert pool.refs[a.pages[0]] == 3 and pool.refs[a.pages[2]] == 2


def decode_message_sizes(context: int) -> list[int]:
    pool = PagePool(400, S, prefix_cache=False)
    sched = Scheduler(pool, 8, 4096, 1600, ())
    reqs = [RequestOutput(i, [1 + i] * context, SamplingParams(max_new_tokens=40, ignore_eos=True))
            for i in range(3)]
    for r in reqs:
        sched.add(r)
    tables, sizes = PageTables(), []
    while sched.has_work():
        plan = sched.schedule()
        msg = issue(sched, plan)
        decode_message(msg, tables)
        if not plan.is_prefill:
            sizes.append(msg.numel())
        sched.update(plan, [5] * len(plan.reqs))
    return sizes


def test_step_message_size_does_not_grow_with_context():
    """Decode steps' messages are the same size at 10 and at 302 tokens of context: they name the pages
    appended, not the tables."""
    short, long = decode_message_sizes(10), decode_message_sizes(302)
    assert short == long
    B = 3
    assert set(short) == {7 + 8 * B, 7 + 8 * B + B}  # head, 3 per token, 5 per row; plus a page each at times


def test_clear_recovers_pages_from_an_alloc_cut_short():
    """After an exception inside a step (Ctrl-C at TP 1, where the engine runs on), the pool is cleared: a
    page popped from the free list before its count was set (an alloc cut short) is free again."""
    pool = PagePool(4, 2)
    pool.register(pool.alloc(1)[0], page_key(ROOT_KEY, [1, 2]))
    pool.free.pop()  # cut between taking the page and counting its reference
    pool.clear()
    assert pool.num_free == 4 and sorted(pool.alloc(4)) == [0, 1, 2, 3] and pool.num_cached == 0
