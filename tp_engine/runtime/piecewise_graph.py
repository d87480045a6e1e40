"""CUDA graphs for prompt and mixed steps, captured in pieces around attention.

Launched eagerly, a step with prompt tokens costs the host about ten Python calls per layer, each tens of
microseconds: for Qwen3-0.6B about 20 ms per step against 5 ms of kernels for a chunk of ~700 tokens, and the
requests decoding beside the chunk wait on all of it. A whole step cannot be one graph, since its attention
depends on every request's chunk and context; nothing else does. The embedding, projections, norms, MLP (or
experts) and the fused Q/K norm + RoPE + K/V write see only the token count. So for each token-count bucket
T the model body is captured as L + 1 graphs, cut at each layer's attention.

A step of N <= T tokens copies its ids, positions and KV slots into static buffers, replays piece 0, attends
eagerly over the first N rows (flashinfer, planned for this step by `prepare` as usual), replays piece 1, and
so on; the LM head then runs eagerly on the real rows. With the fused kernels each piece ends with the decode
kernel of kernels/decode_attention.py over the step's decode rows (a mixed step's leading one-token rows, when
they hold at most its MAX_CONTEXT tokens), whose page table the step copies into a static buffer (rows beyond
them are given no tokens): only the prompt rows then attend eagerly, and the decode rows cost the host no
flashinfer plan and no launch per layer. Rows N..T-1 are padding: they keep stale ids and
positions and write their K/V into the scratch page only. They never mix with real rows, since every op in
the pieces works row by row (the expert routing too). What an EAGLE head reads of the step (its layers'
inputs, fused into features) is stored in the last piece.

TP 1 only: at TP > 1 the pieces would hold the all-reduces, which no test has yet run on hardware there.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tp_engine.attention.flashinfer_backend import FlashInferBackend, StepPlan, slot_rows
from tp_engine.base.batch import Batch, forward_context
from tp_engine.runtime.cuda_graph import no_collection
from tp_engine.kernels import decode_attention
from tp_engine.attention.kv_cache import pages_for

log = logging.getLogger("tp_engine")


def token_buckets(max_tokens: int) -> list[int]:
    """Multiples of 64 up to 1024, then eight sizes per doubling, up to max_tokens (always included): a step
    is padded by at most 63 tokens up to 1024, and by less than 1/8 of its tokens above."""
    sizes, n, step = [], 64, 64
    while n < max_tokens:
        sizes.append(n)
        n += step
        if n >= 16 * step:
            step *= 2
    return sizes + [max_tokens]


def piecewise_graphs(engine) -> "PiecewiseGraphs | None":
    """The runner when the config asks for it and the engine can run it: CUDA, flashinfer with the fused
    Q/K kernel, TP 1 (see the module's note)."""
    most = min(engine.cfg["cuda_graph_max_tokens"], engine.cfg["max_prefill_tokens"])
    attn = engine.attn
    if most <= 0 or not (isinstance(attn, FlashInferBackend) and attn.fuses_qkv):
        return None
    if engine.tp.size > 1:
        if engine.tp.is_first:
            log.info("CUDA graphs for prompt steps: off at TP %d (TP 1 only for now)", engine.tp.size)
        return None
    return PiecewiseGraphs(engine, most)


class PiecewiseGraphs:
    # At capture this object stands in for the engine's backend, which fuses Q/K norm, RoPE and the K/V write:
    # the model, bound to that (Qwen3ForCausalLM.bind), calls its `forward_qkv`, where each piece ends.
    fuses_qkv = True

    def __init__(self, engine, max_tokens: int) -> None:
        t0 = time.perf_counter()
        self.attn: FlashInferBackend = engine.attn
        self.kv, self.model = engine.kv, engine.model
        self.capture, self.spec = engine.capture, engine.spec  # an EAGLE head's features, kept in the pieces
        self.buckets = token_buckets(max_tokens)
        M, dev, a = self.buckets[-1], engine.device, engine.attn
        self.pad_loc = self.kv.scratch_page * self.kv.page_size
        # static inputs and outputs, shared by all buckets (bucket T uses the first T rows)
        self.input_ids = torch.zeros(M, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(M, dtype=torch.int64, device=dev)
        self.out_loc = torch.full((M,), self.pad_loc, dtype=torch.int64, device=dev)
        self.k_rows, self.v_rows = torch.zeros_like(self.out_loc), torch.zeros_like(self.out_loc)
        # a piece's last output
        self.q = torch.zeros(M, a.num_heads, a.head_dim, dtype=engine.dtype, device=dev)
        self.o = torch.zeros_like(self.q)  # attention's output, the next piece's first input
        self.hidden = torch.zeros(M, engine.model_cfg.hidden_size, dtype=engine.dtype, device=dev)
        # the decode rows' page table, [indptr (D + 1) | last page lengths (D) | page ids]: D rows at most,
        # each with the pages of a context the decode kernel takes (a page shared by several rows is listed
        # for each)
        self.decode_rows = min(M, engine.max_batch) if a.ops is not None else 0
        D, S = self.decode_rows, self.kv.page_size
        most = D * pages_for(min(decode_attention.MAX_CONTEXT, engine.max_request_len), S)
        self.decode_capacity = D, most  # what attn.prepare may put in it
        self.decode_table = torch.zeros(2 * D + 1 + most, dtype=torch.int32, device=dev)
        self.decode_table[D + 1:2 * D + 1] = S  # no pages, S tokens in the last: no tokens
        self.decoder = None if not D else decode_attention.PagedDecode(
            self.decode_table[:D + 1], self.decode_table[D + 1:2 * D + 1], self.decode_table[2 * D + 1:],
            a.num_heads, a.num_kv_heads, a.head_dim, S)
        self._decoding = False  # whether the table holds rows now
        self._last = torch.zeros(1, dtype=torch.int64, device=dev)  # the LM head is not in the pieces
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.cuts: list[int] = []  # the layer of each cut, in order
        self._capturing: list[torch.cuda.CUDAGraph] | None = None
        self.steps = 0  # steps run through the pieces
        self._capture(engine.device)
        log.info("CUDA graphs for prompt steps: %d token counts up to %d, %d pieces each, captured in %.1f s",
                 len(self.buckets), M, len(self.cuts) + 1, time.perf_counter() - t0)

    # ---- capture ----

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        with no_collection():
            self._capture_all(device)

    def _capture_all(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for T in reversed(self.buckets):  # the largest first: the others reuse its memory
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compiles the Triton kernels, sets up cuBLAS for these shapes
                    self._body(T)
                torch.cuda.synchronize()
                self.cuts, self._capturing = [], [self._begin()]
                self._body(T)
                self._capturing[-1].capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self.pieces[T], self._capturing = self._capturing, None

    def _begin(self) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        # as cuda_graph.py: "global" hangs NCCL
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        return g

    def _body(self, T: int) -> None:
        """The model body over the first T static rows, into `hidden`; attention is cut out (see
        forward_qkv)."""
        slot_rows(self.out_loc[:T], self.kv.page_size, self.k_rows[:T], self.v_rows[:T])
        plan = StepPlan(None, self.k_rows[:T], self.v_rows[:T])
        batch = Batch(True, self.input_ids[:T], self.positions[:T], self.out_loc[:T], [T], [T], [[]],
                      self._last, plan={"flashinfer": plan})
        with forward_context(batch, self.kv, self, self.capture) as ctx:
            self.hidden[:T].copy_(self.model.model(self.input_ids[:T]))
            if ctx.aux:  # padded rows write the scratch page's
                self.spec.store(batch, ctx.aux)

    def forward_qkv(self, layer: int, qkv: torch.Tensor, attn, kv_cache, batch: Batch) -> torch.Tensor:
        """At capture: Q/K norm, RoPE and the K/V write end the piece; the next starts from attention's
        output."""
        T, D = qkv.shape[0], self.decode_rows
        cache = kv_cache.layer(layer)
        self.attn.store_qkv(qkv, attn, cache, batch.positions, batch.plan["flashinfer"].k_rows,
                            out=self.q[:T])
        if self.decoder is not None:  # writes the rows the table holds, none during capture
            self.decoder.run(self.q[:D], cache, self.o[:D])
        if self._capturing is not None:
            self._capturing[-1].capture_end()
            self.cuts.append(layer)
            self._capturing.append(self._begin())
        return self.o[:T]

    # ---- per step ----

    def can_run(self, batch: Batch) -> bool:
        return len(batch.input_ids) <= self.buckets[-1]

    def _load_decode_rows(self, table: tuple | None) -> None:
        """The decode rows' page table into the static one (one copy from pinned memory); None: no rows."""
        D, S = self.decode_rows, self.kv.page_size
        indptr, last, ids = table if table is not None else (np.zeros(1, np.int32), np.zeros(0, np.int32),
                                                             np.zeros(0, np.int32))
        d = len(last)
        host = np.empty(2 * D + 1 + len(ids), dtype=np.int32)
        host[:d + 1], host[d + 1:D + 1] = indptr, indptr[-1]
        host[D + 1:D + 1 + d], host[D + 1 + d:2 * D + 1] = last, S
        host[2 * D + 1:] = ids
        self.decode_table[:len(host)].copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        self._decoding = table is not None

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor | None:
        """The step's fp32 logits on rank 0 (a prompt step: of each request's last token), as Engine.forward;
        `batch` is planned (attn.prepare) and its token references resolved."""
        N = len(batch.input_ids)
        T = next(t for t in self.buckets if t >= N)
        self.input_ids[:N].copy_(batch.input_ids)
        self.positions[:N].copy_(batch.positions)
        self.out_loc[:N].copy_(batch.out_loc)
        self.out_loc[N:T].fill_(self.pad_loc)
        plan, pieces = batch.plan["flashinfer"], self.pieces[T]
        if plan.decode_table is not None or self._decoding:
            self._load_decode_rows(plan.decode_table)
        for layer, piece in zip(self.cuts, pieces):
            piece.replay()
            self.attn.attend(plan, self.q[:N], self.kv.layer(layer), self.o[:N])
        pieces[-1].replay()
        self.steps += 1
        with forward_context(batch, self.kv, self.attn):
            return self.model.logits(self.hidden[:N])
