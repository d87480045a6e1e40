"""Paged KV cache: one pool of fixed-size pages per layer, and the step's page table every backend reads
(page ownership and the prefix cache: page_pool.py; the per-rank page tables: step_message.py).

Layout per layer is flashinfer's paged NHD layout:
[num_pages, 2 (K, V), page_size, kv_heads_per_rank, head_dim].
"""
from __future__ import annotations

import numpy as np
import torch


CPU_KV_BYTES = 1 << 30  # default KV pool on CPU when kv_cache.num_pages is not set


def budget_pages(per_page: int, most: int) -> int:
    """The pages of a CPU rank's default pool, its scratch page counted: CPU_KV_BYTES, and at most `most`
    (what max_batch_size requests of full length could use). On CUDA, memory_plan.py sizes the pool."""
    return min(CPU_KV_BYTES // per_page - 1, most)


def check_pool(n: int, kvc: dict, per_page: int) -> None:
    """A CPU pool must hold a page; else say which keys to change."""
    if n < 1:
        raise ValueError(f"no room for the KV cache: a page of kv_cache.page_size {kvc['page_size']} tokens "
                         f"takes {per_page:,} bytes per rank, and the CPU budget of {CPU_KV_BYTES >> 20} MiB "
                         "holds fewer than two; lower kv_cache.page_size, or set kv_cache.num_pages "
                         "(or give the model more ranks)")


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        # One extra page past the pool, never handed out: padded rows of a CUDA-graph batch write there.
        self.scratch_page = num_pages
        try:
            self.data = torch.zeros(num_layers, num_pages + 1, 2, page_size, kv_heads, head_dim, dtype=dtype,
                                    device=device)
        except (RuntimeError, TypeError) as e:  # out of memory, or past int64: name the size and the key
            size = (num_pages + 1) * self.bytes_per_page(num_layers, page_size, kv_heads, head_dim, dtype)
            raise ValueError(f"cannot allocate the KV cache: {num_pages:,} pages (kv_cache.num_pages) of "
                             f"{page_size} tokens take {size / 2**30:,.1f} GiB per rank on {device.type}: "
                             f"{str(e).splitlines()[0][:160]}") from None

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def layer(self, i: int) -> torch.Tensor:
        return self.data[i]

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor) -> None:
        """Write the new tokens' K and V ([N, kv_heads, head_dim]) to their flat slots, one kernel each."""
        page, slot = out_loc // self.page_size, out_loc % self.page_size
        cache = self.data[i]
        cache[page, 0, slot] = k
        cache[page, 1, slot] = v


def pages_for(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


def page_table(batch, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's page table in CSR form, as every attention backend reads it; int32 arrays:

    indptr [B + 1]: request i's pages are ids[indptr[i]:indptr[i + 1]]; ids: the pages that hold each
    request's `seq_lens[i]` tokens, in order, requests one after the other; last [B]: tokens in each
    request's last page. `batch` is a batch.Batch: `seq_lens`, and `page_tables`, each request's pages
    (arrays or lists, which may hold more pages than its tokens need)."""
    seq = np.asarray(batch.seq_lens, dtype=np.int32)
    npages = (seq + page_size - 1) // page_size
    if len(seq):
        ids = np.concatenate([np.asarray(t[:n], dtype=np.int32)
                              for t, n in zip(batch.page_tables, npages.tolist())])
    else:
        ids = np.zeros(0, dtype=np.int32)
    indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(npages, out=indptr[1:])
    return indptr, ids, seq - (npages - 1) * page_size
