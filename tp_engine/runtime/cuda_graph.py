"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once at start-up.

A decode batch of B requests runs the graph of the smallest bucket >= B; the graph first takes the
tokens sampled in the previous step from the device (step_tokens.resolve); the padded rows read a dummy
token and write their K/V into the cache's scratch page, so they touch no request's pages. The graph
holds the model's whole forward on this rank (embedding, layers with their all-reduces, final norm, the
LM head and, with TP > 1, its all-gather of the vocab shards), so rank 0 replays and reads logits.

Each bucket has its own flashinfer decode wrapper (use_cuda_graph=True) whose page-table buffers are
views of one static buffer shared by all buckets; `run` copies the step's page table into it (one copy),
re-plans the wrapper and replays. With the fused kernels, each bucket has a second graph whose attention
is the decode kernel of kernels/decode_attention.py over the same buffers (no plan): a step whose requests
all hold at most `decode_attention.MAX_CONTEXT` tokens (where the kernel is the faster) replays that one.

A speculating step of a few tokens a request (the verification: each request's newest token and its
drafts; a proposer's catch-up) runs as one-token rows (`token_rows`): row j of a request of n new tokens and
KV length L has KV length L - n + 1 + j over the same pages. Every row writes its K/V before any attends, so
each sees the rows before it, as causal attention over the request's tokens would.

A runner replays one model: the engine's (`target_step`) or a proposer's (runtime/drafting.py), each with its
own KV cache and attention backend.

Capture uses capture_error_mode="thread_local": the default mode hangs with NCCL on the machines this was
measured on.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from tp_engine.attention.flashinfer_backend import FlashInferBackend, StepPlan
from tp_engine.base.batch import Batch, forward_context
from tp_engine.kernels import decode_attention
from tp_engine.attention.kv_cache import page_table, pages_for
from tp_engine.runtime.step_tokens import resolve

log = logging.getLogger("tp_engine")


# Most new tokens of a request in a step that runs as one-token rows: a verifying request's newest token
# and up to 16 drafts (speculative.num_tokens)
ROW_TOKENS = 17


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, 64, 96, 128, then every 32, up to max_batch (always included)."""
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 32)
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def token_rows(batch: Batch) -> Batch:
    """`batch` as one-token rows, a row per token (see the module's note); its logits are then every token's,
    of which `batch.logit_rows` picks the step's."""
    seq: list[int] = []
    for L, n in zip(batch.seq_lens, batch.extend_lens):
        seq += range(L - n + 1, L + 1)
    tables = [t for t, n in zip(batch.page_tables, batch.extend_lens) for _ in range(n)]
    return replace(batch, is_prefill=False, seq_lens=seq, extend_lens=[1] * len(seq), page_tables=tables,
                   logit_rows=torch.arange(len(seq)), plan={})


def target_step(engine, batch: Batch) -> torch.Tensor | None:
    """The engine's decode step inside a graph: the previous step's tokens (step_tokens.resolve) and the K/V
    rows, the model's forward, LM head and its gather of the vocab shards included (comm.gather_to_rank0 is
    capturable), and what an EAGLE head reads of it. Logits [bs, vocab] in the model's dtype on rank 0, None
    on the others."""
    plan = batch.plan["flashinfer"]
    resolve(batch.input_ids, engine.last_tokens, (batch.out_loc, engine.kv.page_size, plan.k_rows,
                                                  plan.v_rows), engine.ops)
    with forward_context(batch, engine.kv, engine.attn, engine.capture) as ctx:  # the sampler reads bf16
        logits = engine.model(batch.input_ids, fp32=False)  # logits as fp32, exactly
        if ctx.aux:
            engine.spec.store(batch, ctx.aux)
    return logits


@contextlib.contextmanager
def no_collection():
    """No garbage collection while CUDA graphs are captured. An engine dropped in a reference cycle is freed
    when the collector runs; freeing its graphs during another engine's capture ends that capture with an
    error (a new LLM collects before it starts, llm.py)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GraphRunner:
    def __init__(self, engine, max_batch: int, kv, attn, step: Callable[[Batch], object],
                 name: str = "decode") -> None:
        """Graphs of `step`, a model's decode step over a static batch (target_step, or a proposer's), whose
        attention is `attn` over `kv`; it returns a tensor of a row each, None, or a tuple of those."""
        if not isinstance(attn, FlashInferBackend):
            raise ValueError("cuda_graph needs attention_backend flashinfer (or auto on CUDA); "
                             "set cuda_graph: false to run the torch backend on CUDA")
        t0 = time.perf_counter()
        self.engine, self.attn, self.kv, self.step = engine, attn, kv, step
        self.tp = engine.tp
        dev, S = engine.device, self.kv.page_size
        self.buckets = bucket_sizes(max_batch)
        self.max_bs = self.buckets[-1]

        # The static inputs, shared by all buckets (a bucket of size b reads the first b rows), in one
        # device buffer that one host copy fills each step: the token rows [ids | positions | KV slots]
        # (int64, 3 x M), then flashinfer's page table [indptr (M + 1) | last page lengths (M) | page ids]
        # (int32): each row's pages (a page shared by several requests is listed for each), plus a scratch
        # page per padded row.
        M = self.max_bs
        self.pad_loc = self.kv.scratch_page * S
        self.rows_bytes = 3 * M * 8
        nbytes = self.rows_bytes + 4 * (2 * M + 1 + M * pages_for(engine.max_request_len, S) + M)
        self.static = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        # its image on the host, copied whole up to the page ids used
        self.host = np.zeros(nbytes, dtype=np.uint8)
        self.input_ids, self.positions, self.out_loc = (
            self.static[:self.rows_bytes].view(torch.int64).view(3, M))
        self.host_rows = self.host[:self.rows_bytes].view(np.int64).reshape(3, M)
        self.meta = self.static[self.rows_bytes:].view(torch.int32)
        self.host_meta = self.host[self.rows_bytes:].view(np.int32)
        self.k_rows = torch.zeros(M, dtype=torch.int64, device=dev)
        self.v_rows = torch.zeros(M, dtype=torch.int64, device=dev)
        self.logit_rows = torch.arange(M, device=dev)
        self.indptr_buf, self.last_buf, self.indices_buf = self.meta[:M + 1], self.meta[M + 1:2 * M + 1], \
            self.meta[2 * M + 1:]

        # the graphs, keyed by (bucket, whether attention is the decode kernel)
        self.wrappers, self.batches, self.graphs, self.outputs = {}, {}, {}, {}
        for bs in self.buckets:
            bufs = (self.indptr_buf[:bs + 1], self.indices_buf, self.last_buf[:bs])
            self.wrappers[bs] = self.attn.graph_decode_wrapper(*bufs)
            self.batches[bs, False] = self._batch(bs, self.wrappers[bs])
            kernel = self.attn.graph_decode_kernel(*bufs)
            if kernel is not None:
                self.batches[bs, True] = self._batch(bs, kernel)
        self._capture()
        if self.tp.is_first:
            log.info("CUDA graphs: %d %s batch sizes up to %d captured in %.1f s (all-reduce: %s)",
                     len(self.buckets), name, self.max_bs, time.perf_counter() - t0, engine.all_reduce_kind)

    def _batch(self, bs: int, attention) -> Batch:
        """The static batch of a bucket whose attention runs `attention` (a wrapper or the decode kernel)."""
        plan = StepPlan(attention, self.k_rows[:bs], self.v_rows[:bs])
        return Batch(False, self.input_ids[:bs], self.positions[:bs], self.out_loc[:bs], [1] * bs, [1] * bs,
                     [[self.kv.scratch_page]] * bs, self.logit_rows[:bs], plan={"flashinfer": plan})

    # ---- capture ----

    @torch.inference_mode()
    def _capture(self) -> None:
        with no_collection():
            self._capture_all()

    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.engine.device)
        # largest first: the smaller graphs reuse its memory pool
        for key in sorted(self.batches, reverse=True):
            self._plan(key[0], *self._load(key[0], None), kernel=key[1])
            # warm-up on the capture stream: compiles Triton kernels, sets up cuBLAS, NCCL
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.step(self.batches[key])
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
                out = self.step(self.batches[key])
            torch.cuda.synchronize()
            pool = g.pool()
            self.graphs[key], self.outputs[key] = g, out

    # ---- per step ----

    def rows(self, batch: Batch) -> Batch | None:
        """What the graphs run of `batch` (its token rows on the host): a decode step as it is; a verifying
        step or a proposer's forward of at most ROW_TOKENS tokens a request as one-token rows (a prompt step
        runs eagerly or in the pieces, whose attention is the prefill kernel's); None: neither."""
        if not batch.is_prefill:
            return batch if batch.size <= self.max_bs else None
        if not (batch.verify or batch.draft) or len(batch.input_ids) > self.max_bs \
                or max(batch.extend_lens) > ROW_TOKENS:
            return None
        return token_rows(batch)

    def _bucket(self, b: int) -> int:
        for bs in self.buckets:
            if bs >= b:
                return bs
        raise ValueError(f"decode batch of {b} is larger than the largest CUDA graph ({self.max_bs})")

    def _load(self, bs: int, batch: Batch | None) -> tuple[np.ndarray, np.ndarray, int]:
        """Fill the static inputs, `batch` in the first rows and padding after, in one copy from the host;
        returns the page table's indptr, the KV lengths and the number of page ids, for `_plan`."""
        M, S = self.max_bs, self.kv.page_size
        b = 0 if batch is None else batch.size
        kv_lens = np.ones(bs, dtype=np.int32)  # padded rows: one token, in the scratch page
        rows = self.host_rows
        rows[:2, b:bs] = 0
        rows[2, b:bs] = self.pad_loc  # padded rows write K/V into the scratch page only
        if b:
            for i, t in enumerate((batch.input_ids, batch.positions, batch.out_loc)):
                rows[i, :b] = t.cpu().numpy()  # decode_message's rows are on the host already
            table, pages, last_len = page_table(batch, S)
            kv_lens[:b] = batch.seq_lens
        else:  # at capture: every row is padding
            table, pages, last_len = np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)
        pad = bs - b
        h = self.host_meta
        indptr = h[:bs + 1]
        indptr[:b + 1] = table
        indptr[b + 1:] = indptr[b] + np.arange(1, pad + 1, dtype=np.int32)  # one scratch page per padded row
        last = h[M + 1:M + 1 + bs]
        last[:b] = last_len
        last[b:] = 1
        n = int(indptr[bs])
        ids = h[2 * M + 1:2 * M + 1 + n]
        ids[:len(pages)] = pages
        ids[len(pages):] = self.kv.scratch_page
        # one host-to-device copy, from pinned memory so that it queues behind the step still running
        used = self.rows_bytes + 4 * (2 * M + 1 + n)
        self.static[:used].copy_(torch.from_numpy(self.host[:used]).pin_memory(), non_blocking=True)
        return indptr.copy(), kv_lens, n

    def _plan(self, bs: int, indptr: np.ndarray, kv_lens: np.ndarray, n: int, kernel: bool) -> None:
        """Plan the bucket's flashinfer wrapper, unless the step runs the decode kernel (it needs no plan)."""
        if not kernel:
            start = 2 * self.max_bs + 1  # the page ids' place in host_meta (see _load)
            self.attn.plan_graph_decode(self.wrappers[bs], torch.from_numpy(indptr),
                                        torch.from_numpy(kv_lens), self.host_meta[start:start + n])

    @torch.inference_mode()
    def run(self, batch: Batch):
        """Replay the step for `batch` (a decode batch, `rows`' answer); returns the first B rows of what the
        step returned (target_step: logits [B, vocab] in the model's dtype on rank 0, None on the others)."""
        b = batch.size
        bs = self._bucket(b)
        indptr, kv_lens, n = self._load(bs, batch)
        key = bs, (bs, True) in self.graphs and max(batch.seq_lens) <= decode_attention.MAX_CONTEXT
        self._plan(bs, indptr, kv_lens, n, key[1])
        self.graphs[key].replay()
        out = self.outputs[key]
        if isinstance(out, tuple):
            return tuple(t if t is None else t[:b] for t in out)
        return out if out is None else out[:b]
