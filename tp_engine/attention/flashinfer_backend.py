"""flashinfer attention over the paged KV cache (CUDA only).

Eager steps: `BatchPrefillWithPagedKVCacheWrapper` (ragged queries over paged K/V, causal), one for a
step's one-token rows and one for its prompt rows (a mixed step in CUDA-graph pieces may attend its
one-token rows inside the pieces instead: piecewise_graph.py). CUDA-graph decode (cuda_graph.py):
`BatchDecodeWithPagedKVCacheWrapper` with tensor cores. All run the FA2 kernels of one JIT-compiled module.

`prepare(batch)` plans once per step (all layers share the plan); `forward` writes K/V into the pages
(one index_copy_ each, no Python loop) and attends. `forward_qkv` is the fused path the model takes
when the engine runs the fused kernels: one kernel does the Q/K RMSNorm, RoPE and the K/V write
(kernels/norm.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tp_engine.base.batch import Batch
from tp_engine.kernels import decode_attention
from tp_engine.attention.kv_cache import page_table

WORKSPACE_BYTES = 512 << 20  # flashinfer's float workspace (split-KV partial results), shared by all wrappers
# For measuring only (launch/bench.py --no-split-kv, --no-fast-plan): CUDA-graph decode with flashinfer's KV
# split (and its merge kernel), and planned through the compiled planner directly (see plan_graph_decode)
SPLIT_KV = True
FAST_PLAN = True


@dataclass
class StepPlan:
    wrapper: object  # the planned flashinfer wrapper this step runs (over its prompt rows, in a mixed step)
    k_rows: torch.Tensor  # [N] int64: each new token's K row in the layer cache viewed as [rows, kv_heads, d]
    v_rows: torch.Tensor  # [N] int64: the same for V (k_rows + page_size)
    # A mixed step: its first rows, of one token each, attend apart from its prompt rows, through the
    # decode wrapper, or inside the CUDA-graph pieces (piecewise_graph.py) when decode_table holds their
    # page table (indptr, last page lengths, page ids)
    decode_rows: int = 0
    decode_table: tuple | None = None


def slot_rows(out_loc: torch.Tensor, page_size: int, k_rows: torch.Tensor | None = None,
              v_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot (page * page_size + offset) -> rows of K and V in a layer cache viewed as
    [pages*2*S, H, D]."""
    k = torch.add(out_loc, torch.div(out_loc, page_size, rounding_mode="floor") * page_size, out=k_rows)
    v = torch.add(k, page_size, out=v_rows)
    return k, v


class PlanGuard:
    """plan() fills a pinned host buffer and queues its copy to the GPU; planning the same wrapper again
    before that copy ran would overwrite what the GPU is about to read. Wait for the previous copy first."""

    def __init__(self) -> None:
        self._events: dict[int, torch.cuda.Event] = {}

    def before(self, wrapper) -> None:
        ev = self._events.get(id(wrapper))
        if ev is not None:
            ev.synchronize()

    def after(self, wrapper) -> None:
        ev = self._events.get(id(wrapper))
        if ev is None:
            ev = self._events[id(wrapper)] = torch.cuda.Event()
        ev.record()


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, max_batch: int = 256, num_pages: int = 0, ops=None, **_) -> None:
        """ops: the engine's fused kernels (kernels.select) or None: no fused Q/K path, no decode kernel."""
        import flashinfer

        self.fi = flashinfer
        self.device, self.dtype = device, dtype
        (self.num_heads, self.num_kv_heads, self.head_dim, self.page_size) = (
            num_heads, num_kv_heads, head_dim, page_size)
        self.max_batch, self.num_pages = max_batch, num_pages
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Eager steps plan their one-token rows and their prompt rows apart (see prepare), both through the
        # prefill planner: it takes every host array it copies from the caller (see _plan). The decode
        # wrapper with tensor cores runs the same kernels; CUDA-graph decode keeps it.
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self.decode_rows_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self.split_kv = SPLIT_KV
        self.guard = PlanGuard()
        self._fast_plans: dict[int, object] = {}
        self.ops = ops
        self.fuses_qkv = ops is not None  # as attention.fuses_qkv says

    # ---- planning, once per step ----

    def prepare(self, batch: Batch, graph_decode: tuple[int, int] = (0, 0)) -> None:
        """graph_decode: the most decode rows, and page ids listed for them, of a mixed step that the caller's
        CUDA-graph pieces attend themselves (piecewise_graph.py) with the decode kernel, when their contexts
        are short."""
        kv_indptr, indices, last_len = page_table(batch, self.page_size)
        lens, seq = batch.extend_lens, np.asarray(batch.seq_lens, dtype=np.int32)
        # A mixed step's leading rows of one token attend like decode rows. Planned together with the prompt
        # rows, they would shrink the query tile flashinfer picks for all rows (from the average query
        # length), and a long prompt's chunk would re-read its whole context once per 16 queries.
        d, table = batch.decode_rows, None
        rows, pages = graph_decode
        if 0 < d < len(lens) and d <= rows and kv_indptr[d] <= pages \
                and int(seq[:d].max()) <= decode_attention.MAX_CONTEXT:
            table = kv_indptr[:d + 1], last_len[:d], indices[:kv_indptr[d]]  # no plan, no launch per layer
        elif d:
            self._plan(self.decode_rows_wrapper, np.arange(d + 1, dtype=np.int32), kv_indptr[:d + 1],
                       indices[:kv_indptr[d]], last_len[:d], seq[:d])
        wrapper = self.decode_rows_wrapper
        if d < len(lens):
            # causal: each row's queries are the last of its KV (a chunk after its cached prefix, shared
            # or not)
            wrapper = self.prefill_wrapper
            qo_indptr = np.zeros(len(lens) - d + 1, dtype=np.int32)
            np.cumsum(lens[d:], out=qo_indptr[1:])
            self._plan(wrapper, qo_indptr, kv_indptr[d:] - kv_indptr[d], indices[kv_indptr[d]:], last_len[d:],
                       seq[d:])
        k_rows, v_rows = slot_rows(batch.out_loc, self.page_size)
        batch.plan["flashinfer"] = StepPlan(wrapper, k_rows, v_rows,
                                            d if wrapper is self.prefill_wrapper else 0, table)

    def _plan(self, wrapper, qo_indptr: np.ndarray, kv_indptr: np.ndarray, indices: np.ndarray,
              last_len: np.ndarray, seq_lens: np.ndarray) -> None:
        """Plan from pinned copies of the host arrays: flashinfer's copies of them to the GPU then queue
        behind the work already there. From pageable memory each copy would wait for the GPU to finish that
        work, and the host could no longer prepare a step while the GPU runs the one before."""
        pinned = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).pin_memory()
                  for a in (qo_indptr, kv_indptr, indices, last_len, seq_lens)]
        self.guard.before(wrapper)
        wrapper.plan(*pinned[:4], self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
                     causal=True, q_data_type=self.dtype, kv_data_type=self.dtype, seq_lens=pinned[4])
        self.guard.after(wrapper)

    def graph_decode_wrapper(self, indptr_buf: torch.Tensor, indices_buf: torch.Tensor,
                             last_buf: torch.Tensor):
        """A decode wrapper for one CUDA-graph batch size (len(last_buf)), reading its page table from the
        given static buffers, which plan() refills before every replay."""
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
            paged_kv_last_page_len_buffer=last_buf)

    def graph_decode_kernel(self, indptr_buf: torch.Tensor, indices_buf: torch.Tensor,
                            last_buf: torch.Tensor):
        """The decode kernel of kernels/decode_attention.py over the same page-table buffers (no plan), or
        None without the fused kernels. A step runs it or the wrapper (see cuda_graph.py)."""
        if self.ops is None:
            return None
        return decode_attention.PagedDecode(indptr_buf, last_buf, indices_buf, self.num_heads,
                                            self.num_kv_heads, self.head_dim, self.page_size)

    def plan_graph_decode(self, wrapper, kv_indptr: torch.Tensor, kv_lens: torch.Tensor,
                          indices: np.ndarray) -> None:
        """Plan a CUDA-graph decode wrapper whose page-table buffers the caller has already filled (kv_indptr
        and kv_lens: int32 host copies of the indptr and the KV lengths; indices: the page ids in use, on the
        host).

        The first plan goes through `wrapper.plan`; later ones call the compiled planner directly with the
        arguments `plan` would pass it, skipping the wrapper's Python-side checks and copies, which cost more
        than the planning itself at small batch. The direct path is checked against the wrapper's own plan
        once (the verdict is kept either way) and not used when the two disagree (or FAST_PLAN is off)."""
        self.guard.before(wrapper)
        fast = self._fast_plans.get(id(wrapper))
        if fast is not None:
            wrapper._plan_info = fast(kv_indptr, kv_lens)
        else:
            last = kv_lens - (kv_indptr[1:] - kv_indptr[:-1] - 1) * self.page_size
            ids = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int32)).pin_memory()  # see _plan
            wrapper.plan(kv_indptr, ids, last, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.page_size, q_data_type=self.dtype, kv_data_type=self.dtype,
                         disable_split_kv=not self.split_kv)
            if id(wrapper) not in self._fast_plans:
                self._fast_plans[id(wrapper)] = self._make_fast_plan(wrapper, kv_indptr, kv_lens)
        self.guard.after(wrapper)

    def _make_fast_plan(self, wrapper, kv_indptr: torch.Tensor, kv_lens: torch.Tensor):
        if not FAST_PLAN:
            return None
        try:
            if not (wrapper.is_cuda_graph_enabled and wrapper.use_tensor_cores and wrapper._backend == "fa2"
                    and getattr(wrapper, "_jit_module", None) is None):
                return None
            module, bs = wrapper._cached_module, wrapper._fixed_batch_size
            qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
            bufs = (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
                    wrapper._pin_memory_int_workspace_buffer)

            def fast(indptr: torch.Tensor, lens: torch.Tensor):
                return module.plan(*bufs, qo_indptr, indptr, lens, bs, bs, self.num_heads, self.num_kv_heads,
                                   self.page_size, True, self.head_dim, self.head_dim, False, -1, -1,
                                   not self.split_kv, 0, 0)

            self.guard.after(wrapper)
            self.guard.before(wrapper)
            if list(fast(kv_indptr, kv_lens)) != list(wrapper._plan_info):
                return None
            return fast
        except Exception:  # another flashinfer release: the public plan() keeps working
            return None

    # ---- per layer ----

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache,
                batch: Batch) -> torch.Tensor:
        """q: [N, heads, d], k/v: [N, kv_heads, d] -> [N, heads, d]; stores k/v in the cache first."""
        plan: StepPlan = batch.plan["flashinfer"]
        cache = kv_cache.layer(layer)
        rows = cache.view(-1, self.num_kv_heads, self.head_dim)
        rows.index_copy_(0, plan.k_rows, k.to(cache.dtype))
        rows.index_copy_(0, plan.v_rows, v.to(cache.dtype))
        q = q.contiguous()
        return self.attend(plan, q, cache, torch.empty_like(q))

    def forward_qkv(self, layer: int, qkv: torch.Tensor, attn, kv_cache, batch: Batch) -> torch.Tensor:
        """The fused path: qkv [N, (heads + 2 kv_heads) * d] straight from the projection -> [N, heads, d].

        `attn` is the model's attention module (q_norm, k_norm, rotary)."""
        plan: StepPlan = batch.plan["flashinfer"]
        cache = kv_cache.layer(layer)
        q = self.store_qkv(qkv, attn, cache, batch.positions, plan.k_rows)
        return self.attend(plan, q, cache, torch.empty_like(q))

    def store_qkv(self, qkv: torch.Tensor, attn, cache: torch.Tensor, positions: torch.Tensor,
                  k_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Q/K RMSNorm and RoPE, K and V written to the layer's `cache` (rows k_rows); returns Q
        [N, heads, d]."""
        return self.ops.qk_norm_rope_store(qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
                                           attn.rotary.cos, attn.rotary.sin, positions, k_rows, cache,
                                           self.num_heads, self.num_kv_heads, self.head_dim,
                                           self.page_size, out)

    def attend(self, plan: StepPlan, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Attention of the planned step's queries q [N, heads, d] over the layer's cache, into `out`."""
        d = plan.decode_rows
        if d and plan.decode_table is None:  # the runs share the float workspace: one after the other
            self.decode_rows_wrapper.run(q[:d], cache, out=out[:d])
        plan.wrapper.run(q[d:], cache, out=out[d:])
        return out
