"""GPU: prompt and mixed steps without host stalls: CUDA graphs in pieces around attention
(piecewise_graph.py), and attention plans that do not wait for the GPU; in bf16.

The checkpoint knows gpu_helpers.SEQUENCES by heart (peaked logits). Needs a CUDA GPU (marker `gpu`).
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import BF16, DEV, HAS_CUDA, NEAR_TIE_ABS, NEAR_TIE_REL, SEQUENCES, assert_parity, generate, \
    hf_greedy, llm, needs_flashinfer, step_batch
from test_gpu_sampling import check_logprobs
from tp_engine.sampling.sampler import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def test_chunked_prompts_through_graph_pieces_follow_transformers(tiny_ckpt, hf_ref):
    """Prompts in chunks of at most 12 tokens beside decoding requests: every step with prompt tokens runs
    through the pieces; tokens and logprobs follow transformers."""
    needs_flashinfer()
    m = llm(tiny_ckpt, max_prefill_tokens=12, prefix_cache=False)
    e = m.engine
    assert e.pieces is not None
    prompt_steps = []
    forward = e.forward
    e.forward = lambda batch: prompt_steps.append(batch.is_prefill) or forward(batch)
    prompts = [SEQUENCES[i][:n].tolist() for i, n in zip(range(6), (40, 3, 29, 17, 8, 36))]
    outs = m.generate([{"input_ids": p} for p in prompts], SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                                           logprobs=5))
    assert e.pieces.steps == sum(prompt_steps) > 6  # chunked: more prompt steps than prompts
    ours = [o["output_token_ids"] for o in outs]
    assert_parity(hf_ref, prompts, ours, [hf_greedy(hf_ref, [p], 8)[0] for p in prompts])
    assert check_logprobs(hf_ref, prompts, outs) == 48



def test_decode_rows_in_the_pieces_list_more_pages_than_the_pool_holds(tiny_ckpt, hf_ref):
    """Eight prompts sharing 32 tokens (8 pages of 4) through a pool of 40 pages, prefilled in chunks beside
    the requests already decoding: the decode rows' page table lists each shared page once per row, more page
    ids than the pool has pages, and the pieces' table takes them; tokens follow transformers."""
    needs_flashinfer()
    m = llm(tiny_ckpt, max_prefill_tokens=12, kv_cache={"num_pages": 40, "page_size": 4})
    e = m.engine
    listed = []
    load = e.pieces._load_decode_rows
    e.pieces._load_decode_rows = \
        lambda table: listed.append(0 if table is None else len(table[2])) or load(table)
    prompts = [SEQUENCES[0][:n].tolist() for n in range(33, 41)]  # with 8 new tokens, all within the sequence
    ours = generate(m, prompts, max_new_tokens=8)
    assert max(listed) > e.kv.num_pages
    assert_parity(hf_ref, prompts, ours, [hf_greedy(hf_ref, [p], 8)[0] for p in prompts])


def test_graph_pieces_compute_the_eager_step_and_write_only_its_slots(tiny_ckpt):
    """One mixed step of 38 tokens (a decode row, then two prompt chunks over cached context), padded to 64 in
    the pieces: its logits and the K/V it writes agree with the eager step's, and no other slot of the cache
    changes (the 26 padded rows write the scratch page only). In the pieces the decode row attends through the
    decode kernel inside the graphs, eagerly through flashinfer; a prompt-only step then empties the pieces'
    table of decode rows."""
    needs_flashinfer()
    m = llm(tiny_ckpt, cuda_graph_max_tokens=256, kv_cache={"num_pages": 32, "page_size": 16})
    e = m.engine
    torch.manual_seed(0)
    e.kv.data.normal_()  # context the step attends over, and slots a stray write would change
    before = e.kv.data.clone()
    results, pieces_runner = {}, e.pieces
    for pieces in (pieces_runner, None):
        e.kv.data.copy_(before)
        e.pieces = pieces
        batch = step_batch(True, [10, 20, 37], [1, 20, 17], [[1], [2, 3], [4, 5, 6]], 16, DEV)
        batch.input_ids.copy_(torch.randint(2, 2048, (38,), generator=torch.Generator().manual_seed(1)))
        steps = getattr(pieces, "steps", 0)
        logits = e.forward(batch)
        assert pieces is None or pieces.steps == steps + 1
        assert (batch.plan["flashinfer"].decode_table is not None) == (pieces is not None)
        results[pieces is None] = (logits.clone(), e.kv.data.clone())
    (lg, kg), (le, ke) = results[False], results[True]
    bound = max(NEAR_TIE_ABS, NEAR_TIE_REL * le.abs().max().item())
    assert lg.shape == le.shape == (3, 2048) and (lg - le).abs().max().item() < bound
    written = torch.zeros(e.kv.data.shape[1:4], dtype=torch.bool, device=DEV)  # [pages, K/V, slot]
    loc = batch.out_loc
    written[loc // 16, :, loc % 16] = True
    written[e.kv.scratch_page] = True
    mask = written[None, ..., None, None].expand_as(kg)
    assert torch.equal(kg[~mask], before[~mask]), "a padded row wrote outside the scratch page"
    assert torch.equal(ke[~mask], before[~mask])
    new_g, new_e = kg[:, loc // 16, :, loc % 16].float(), ke[:, loc // 16, :, loc % 16].float()
    assert (new_g - new_e).abs().max().item() < 0.05 * new_e.abs().max().item()
    assert not torch.equal(new_g, before[:, loc // 16, :, loc % 16].float())  # the step did write its K/V
    e.pieces = pieces_runner
    D = pieces_runner.decode_rows
    assert pieces_runner._decoding and pieces_runner.decode_table[1].item() > 0  # the decode row's pages
    e.forward(step_batch(True, [20], [20], [[2, 3]], 16, DEV))  # no decode rows
    table = pieces_runner.decode_table
    assert not pieces_runner._decoding and not table[:D + 1].any() and (table[D + 1:2 * D + 1] == 16).all()


def test_planning_a_step_does_not_wait_for_the_gpu():
    """prepare() hands flashinfer pinned copies of the step's page table, so it returns while the GPU is still
    busy with earlier work: the host prepares step k + 1 while the GPU runs step k."""
    needs_flashinfer()
    from tp_engine.attention.flashinfer_backend import FlashInferBackend
    fi = FlashInferBackend(device=DEV, num_heads=4, num_kv_heads=2, head_dim=128, page_size=16, dtype=BF16,
                           max_batch=8, num_pages=64)
    steps = {"mixed": step_batch(True, [10, 40, 37], [1, 20, 17], [[1], [2, 3, 4], [5, 6, 7]], 16, DEV),
             "decode": step_batch(False, [10, 40], [1, 1], [[1], [2, 3, 4]], 16, DEV)}
    for name, batch in steps.items():
        fi.prepare(batch)  # the first plan may load flashinfer's module
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 30)  # about half a second of GPU work queued ahead
        fi.prepare(batch)
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert busy, f"planning a {name} step waited for the GPU's queued work"
