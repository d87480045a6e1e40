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

Capture uses capture_error_mode="thread_local": the default mode hangs with NCCL on the machines this was
measured on.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time

import numpy as np
import torch

from tp_engine.attention.flashinfer_backend import FlashInferBackend, StepPlan
from tp_engine.base.batch import Batch, forward_context
from tp_engine.kernels import decode_attention
from tp_engine.attention.kv_cache import page_table, pages_for
from tp_engine.runtime.step_tokens import resolve

log = logging.getLogger("tp_engine")


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, 64, 96, 128, then every 32, up to max_batch (always included)."""
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 32)
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


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
    def __init__(self, engine, max_batch: int) -> None:
        if not isinstance(engine.attn, FlashInferBackend):
            raise ValueError("cuda_graph needs attention_backend flashinfer (or auto on CUDA); "
                             "set cuda_graph: false to run the torch backend on CUDA")
        t0 = time.perf_counter()
        self.engine, self.model, self.attn, self.kv = engine, engine.model, engine.attn, engine.kv
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
            log.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s (all-reduce: %s)",
                     len(self.buckets), self.max_bs, time.perf_counter() - t0, engine.all_reduce_kind)

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
                    self._step(key)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
                out = self._step(key)
            torch.cuda.synchronize()
            pool = g.pool()
            self.graphs[key], self.outputs[key] = g, out

    def _step(self, key: tuple[int, bool]) -> torch.Tensor | None:
        """The captured work: one decode step of the model on this rank for the first `bs` static rows, the
        model's own forward, LM head and its gather of the vocab shards included (comm.gather_to_rank0 is
        capturable); logits [bs, vocab] in the model's dtype on rank 0, None on the others."""
        bs, batch = key[0], self.batches[key]
        # the tokens of the previous step, from the device, and the K/V rows (one launch with the fused
        # kernels)
        resolve(self.input_ids[:bs], self.engine.last_tokens,
                (self.out_loc[:bs], self.kv.page_size, self.k_rows[:bs], self.v_rows[:bs]), self.engine.ops)
        with forward_context(batch, self.kv, self.attn):  # the sampler reads bf16 logits as fp32, exactly
            return self.model(self.input_ids[:bs], fp32=False)

    # ---- per step ----

    def can_run(self, batch: Batch) -> bool:
        return batch.size <= self.max_bs

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
    def run(self, batch: Batch) -> torch.Tensor | None:
        """Replay the decode step for `batch`; rank 0 gets logits [>= B, vocab] (the model's dtype), the
        others None."""
        b = batch.size
        bs = self._bucket(b)
        indptr, kv_lens, n = self._load(bs, batch)
        key = bs, (bs, True) in self.graphs and max(batch.seq_lens) <= decode_attention.MAX_CONTEXT
        self._plan(bs, indptr, kv_lens, n, key[1])
        self.graphs[key].replay()
        return self.outputs[key][:b] if self.tp.is_first else None
