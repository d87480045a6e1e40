"""The sampler's draws and the step's token references, fused: the arg-max over the vocabulary (greedy, or of
temperature + hashed Gumbel noise) in one launch; the top-k candidates of each row in two reads of the
logits; and the previous step's tokens into the step's input ids."""
from __future__ import annotations

import torch

from tp_engine.kernels import triton

if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _exp, _log

    @triton.jit
    def _gumbel(x, h, ids):
        """x + the Gumbel noise of sampler.uniform_noise at token ids `ids` of the row whose hash start is h;
        uint32 arithmetic wraps exactly like its `& 0xFFFFFFFF`."""
        v = h + ids.to(tl.uint32) * 0x9E3779B1
        v = ((v >> 16) ^ v) * 0x45D9F3B
        v = ((v >> 16) ^ v) * 0x45D9F3B
        v = (v >> 16) ^ v
        u = ((v >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        u = tl.minimum(u, 0.99999994039535522)  # topk_sampling.U_MAX: never 1.0, whose noise is infinite
        return x - _log(-_log(u))

    @triton.jit
    def _argmax_kernel(logits_ptr, stride, rows_ptr, temp_ptr, hash_ptr, val_ptr, idx_ptr, count_ptr, out_ptr,
                       vocab, num_chunks, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, NOISE: tl.constexpr):
        """The arg-max of row rows[r] of the logits (NOISE: of logits / T + Gumbel noise), torch.argmax's
        pick: the first NaN, else the lowest id of the maximum. A program takes one chunk of the row and
        stores its best; the row's last program to finish (an atomic counter, reset for the next call) picks
        among them."""
        r = tl.program_id(0)
        chunk = tl.program_id(1)
        if NOISE:
            row = tl.load(rows_ptr + r).to(tl.int64)
        else:  # every row, in order
            row = r.to(tl.int64)
        ids = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = ids < vocab
        x = tl.load(logits_ptr + row * stride + ids, mask=mask, other=float("-inf")).to(tl.float32)
        if NOISE:
            x = tl.where(mask, _gumbel(tl.math.div_rn(x, tl.load(temp_ptr + r)),
                                       tl.load(hash_ptr + r).to(tl.uint32), ids),
                         float("-inf"))
        nan = x != x
        first_nan = tl.min(tl.where(nan, ids, vocab), axis=0)
        best, arg = tl.max(tl.where(nan, float("-inf"), x), axis=0, return_indices=True,
                           return_indices_tie_break_left=True)
        part = r * num_chunks + chunk
        tl.store(val_ptr + part, tl.where(first_nan < vocab, float("nan"), best))
        tl.store(idx_ptr + part, tl.where(first_nan < vocab, first_nan, chunk * BLOCK + arg))
        tl.debug_barrier()  # the partials are written before the counter moves
        if tl.atomic_add(count_ptr + r, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:
            c = tl.arange(0, CHUNKS)
            valid = c < num_chunks
            v = tl.load(val_ptr + r * num_chunks + c, mask=valid, other=float("-inf"), cache_modifier=".cg")
            i = tl.load(idx_ptr + r * num_chunks + c, mask=valid, other=0, cache_modifier=".cg")
            nan_chunk = tl.min(tl.where(v != v, c, CHUNKS), axis=0)
            top = tl.max(tl.where(v != v, float("-inf"), v), axis=0)
            top_chunk = tl.min(tl.where(valid & (v == top), c, CHUNKS), axis=0)
            pick = tl.where(nan_chunk < CHUNKS, nan_chunk, top_chunk)
            tl.store(out_ptr + r, tl.sum(tl.where(c == pick, i, 0), axis=0))
            tl.store(count_ptr + r, 0)

    @triton.jit
    def _order_keys(logits_ptr, stride, rows_ptr, temp_ptr, vocab, BLOCK: tl.constexpr):
        """The order keys (topk_sampling.order_key of logits / temperature) of this program's chunk of its
        row; lanes past the vocabulary get one below every real key (the largest NaN's)."""
        r = tl.program_id(0)
        row = tl.load(rows_ptr + r).to(tl.int64)
        ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = ids < vocab
        x = tl.math.div_rn(tl.load(logits_ptr + row * stride + ids, mask=mask, other=0.0).to(tl.float32),
                           tl.load(temp_ptr + r))
        bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))  # -0.0 ranks as +0.0
        # every NaN as the positive one: first (topk_sampling.order_key)
        bits = tl.where(x != x, 0x7FC00000, bits)
        bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # arithmetic shift: negative floats reverse their order
        key = (bits.to(tl.int64) << 32) | (vocab - 1 - ids).to(tl.int64)
        return tl.where(mask, key, -9223372036854775807 - 1)

    @triton.jit
    def _chunk_max_kernel(logits_ptr, stride, rows_ptr, temp_ptr, max_ptr, vocab, num_chunks,
                          BLOCK: tl.constexpr):
        """The largest order key of one chunk of a row."""
        key = _order_keys(logits_ptr, stride, rows_ptr, temp_ptr, vocab, BLOCK)
        tl.store(max_ptr + tl.program_id(0).to(tl.int64) * num_chunks + tl.program_id(1), tl.max(key, axis=0))

    @triton.jit
    def _topk_keys_kernel(logits_ptr, stride, rows_ptr, temp_ptr, floor_ptr, keys_ptr, vocab, num_chunks,
                          K: tl.constexpr, BLOCK: tl.constexpr):
        """The largest order keys of one chunk of a row, at most K and none below the row's floor; the
        chunk's other K slots get the smallest key."""
        r = tl.program_id(0)
        key = _order_keys(logits_ptr, stride, rows_ptr, temp_ptr, vocab, BLOCK)
        smallest = -9223372036854775807 - 1
        out = keys_ptr + (r.to(tl.int64) * num_chunks + tl.program_id(1)) * K
        tl.store(out + tl.arange(0, K), tl.full([K], smallest, tl.int64))
        tl.debug_barrier()  # the slots are cleared before any round writes one
        floor = tl.load(floor_ptr + r)
        best = tl.max(key, axis=0)
        i = 0
        while (i < K) & (best >= floor):  # keys are unique: each round removes exactly the one it stored
            tl.store(out + i, best)
            key = tl.where(key == best, smallest, key)
            best = tl.max(key, axis=0)
            i += 1

    # a row's values are read one at a time: no compile per alignment of a view (group_inputs' second rows)
    @triton.jit(do_not_specialize=["rows_ptr", "temp_ptr", "k_ptr", "p_ptr", "hash_ptr"])
    def _draw_among_kernel(logits_ptr, stride, rows_ptr, temp_ptr, ids_ptr, k_ptr, p_ptr, hash_ptr, out_ptr,
                           C, BLOCK: tl.constexpr):
        """topk_sampling.draw_among for one row: its C candidates (ids in rank order), top-k and top-p masks,
        Gumbel-max over what is left, the lower id on a tie."""
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + r * C + c, mask=c < C, other=0)
        row = tl.load(rows_ptr + r).to(tl.int64)
        x = tl.math.div_rn(tl.load(logits_ptr + row * stride + ids, mask=c < C, other=0.0).to(tl.float32),
                           tl.load(temp_ptr + r))
        x = tl.where(c < tl.minimum(tl.load(k_ptr + r), C), x, float("-inf"))
        e = _exp(x - tl.max(x, axis=0))
        probs = tl.math.div_rn(e, tl.sum(e, axis=0))
        # cumsum as torch's on the CPU: left to right in float64, each sum rounded to float32. Mass ties at
        # the top-p boundary (equal logits) depend on the order of the sum.
        total = tl.zeros([1], dtype=tl.float64)
        before = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(BLOCK):
            p_i = tl.sum(tl.where(c == i, probs, 0.0), axis=0)  # exact: one term is not zero
            total += p_i.to(tl.float64)
            before = tl.where(c == i, tl.sum(total, axis=0).to(tl.float32) - p_i, before)
        top_p = tl.load(p_ptr + r)
        top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # 1: keep all (topk_sampling._mask_sorted)
        x = tl.where(before >= top_p, float("-inf"), x)
        g = _gumbel(x, tl.load(hash_ptr + r).to(tl.uint32), ids)
        none = 1 << 62
        # a NaN wins, as in topk_sampling._gumbel_pick
        first_nan = tl.min(tl.where(g != g, ids, none), axis=0)
        best = tl.max(tl.where(g != g, float("-inf"), g), axis=0)
        pick = tl.min(tl.where(g == best, ids, none), axis=0)
        tl.store(out_ptr + r, tl.where(first_nan < none, first_nan, pick))

    @triton.jit(do_not_specialize=["n", "page_size"])
    def _resolve_tokens_kernel(ids_ptr, last_ptr, loc_ptr, k_ptr, v_ptr, n, page_size, BLOCK: tl.constexpr,
                               ROWS: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        ids = tl.load(ids_ptr + offs, mask=m, other=0)
        ref = ids < 0
        tok = tl.load(last_ptr + tl.where(ref, -1 - ids, 0), mask=m & ref, other=0)
        tl.store(ids_ptr + offs, tl.where(ref, tok, ids), mask=m)
        # as attention/flashinfer_backend.slot_rows: each slot's K and V rows in a [pages * 2 * S, ...] cache
        if ROWS:
            loc = tl.load(loc_ptr + offs, mask=m, other=0)
            k = loc + (loc // page_size) * page_size  # slots are >= 0: // is the floor division
            tl.store(k_ptr + offs, k, mask=m)
            tl.store(v_ptr + offs, k + page_size, mask=m)


ARGMAX_BLOCK = 4096
_COUNTERS: dict = {}  # per device: one zeroed int32 counter per row, each left at zero by the kernel


def _argmax(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor | None,
            row_hash: torch.Tensor | None) -> torch.Tensor:
    vocab, r = logits.shape[-1], rows.numel()
    assert logits.stride(-1) == 1 and logits.is_floating_point()  # read as fp32: bf16 and fp16 exactly
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r == 0:
        return out
    chunks = triton.cdiv(vocab, ARGMAX_BLOCK)
    vals = torch.empty(r * chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(r * chunks, dtype=torch.int64, device=logits.device)
    count = _COUNTERS.get(logits.device)
    if count is None or count.numel() < r:
        count = _COUNTERS[logits.device] = torch.zeros(max(r, 256), dtype=torch.int32, device=logits.device)
    noise = temperatures is not None
    _argmax_kernel[(r, chunks)](logits, logits.stride(0), rows, temperatures if noise else rows,
                                row_hash if noise else rows, vals, idx, count, out, vocab, chunks,
                                BLOCK=ARGMAX_BLOCK, CHUNKS=triton.next_power_of_2(chunks), NOISE=noise,
                                num_warps=8)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, vocab] (fp32, or bf16 / fp16, read as fp32) -> [B] int64, as logits.argmax(dim=-1), in one
    kernel."""
    rows = logits.new_empty(logits.shape[0], dtype=torch.int64)  # never read: the kernel takes every row
    return _argmax(logits, rows, None, None)


def gumbel_argmax(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                  row_hash: torch.Tensor) -> torch.Tensor:
    """argmax over the vocab of logits[rows] / T + Gumbel noise from the sampler's hash; returns [R] int64.

    rows: [R] int64 row indices into logits ([B, vocab], as in `argmax`); temperatures: [R] fp32;
    row_hash: [R] int64, the per-row hash `sampler.uniform_noise` starts from.
    """
    return _argmax(logits, rows, temperatures, row_hash)


TOPK_BLOCK = 2048
TOPK_MAX_K = 64  # beyond this the sampler ranks the whole row with torch.topk (topk_sampling.candidate_draw)


def topk_candidates(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                    k: int, block: int = TOPK_BLOCK) -> torch.Tensor:
    """The ids [R, k] of the k largest values of logits[rows] / temperatures[:, None], largest first and
    the lower id first among equal values: exactly topk_sampling's order, from two reads of the logits.

    The first read takes each chunk's largest order key; the k-th largest of those is the row's floor: k
    keys reach it, so the row's top k all do. The second read keeps, per chunk, its largest keys down to
    the floor (at most k: no more of a chunk's keys are in the row's top k), mostly one or two rounds of a
    max rather than k; torch.topk then ranks the R x chunks x k survivors."""
    vocab = logits.shape[-1]
    assert logits.stride(-1) == 1 and logits.is_floating_point() and 1 <= k <= min(TOPK_MAX_K, vocab)
    r = rows.numel()
    chunks = triton.cdiv(vocab, block)
    maxes = torch.empty((r, chunks), dtype=torch.int64, device=logits.device)
    _chunk_max_kernel[(r, chunks)](logits, logits.stride(0), rows, temperatures, maxes, vocab, chunks,
                                   BLOCK=block, num_warps=8)
    if k <= chunks:
        floor = maxes.topk(k, dim=-1, sorted=True).values[:, -1].contiguous()
    else:  # fewer chunks than k: every chunk keeps its k largest
        floor = torch.full((r,), -(1 << 63), dtype=torch.int64, device=logits.device)
    kp = triton.next_power_of_2(k)  # one compiled kernel per power of two
    keys = torch.empty((r, chunks * kp), dtype=torch.int64, device=logits.device)
    _topk_keys_kernel[(r, chunks)](logits, logits.stride(0), rows, temperatures, floor, keys, vocab, chunks,
                                   K=kp, BLOCK=block, num_warps=8)
    best = keys.topk(k, dim=-1, sorted=True).values
    return (vocab - 1) - (best & 0xFFFFFFFF)


def draw_among(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor, ids: torch.Tensor,
               top_k: torch.Tensor, top_p: torch.Tensor, row_hash: torch.Tensor) -> torch.Tensor:
    """topk_sampling.draw_among in one kernel: the chosen id [R] (int64) of each row among its candidates
    ids [R, C] (from `topk_candidates`), with the values logits[rows] / temperatures at those ids."""
    r, c = ids.shape
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r:
        _draw_among_kernel[(r,)](logits, logits.stride(0), rows, temperatures, ids, top_k, top_p, row_hash,
                                 out, c, BLOCK=max(16, triton.next_power_of_2(c)), num_warps=1)
    return out


RESOLVE_BLOCK = 256  # one compiled kernel for any count of ids (neither it nor the page size is specialized)


def resolve_tokens(ids: torch.Tensor, last: torch.Tensor, slots: tuple | None = None) -> torch.Tensor:
    """In place: each id < 0 becomes last[-1 - id] (step_tokens.resolve), in one kernel. slots:
    (out_loc, page_size, k_rows, v_rows) also fills k_rows and v_rows as
    attention/flashinfer_backend.slot_rows does, in the same kernel (a decode graph's first launch)."""
    n = ids.numel()
    if n:
        loc, page_size, k_rows, v_rows = slots if slots is not None else (ids, 1, ids, ids)
        assert loc.numel() == k_rows.numel() == v_rows.numel() == n
        _resolve_tokens_kernel[(triton.cdiv(n, RESOLVE_BLOCK),)](ids, last, loc, k_rows, v_rows, n, page_size,
                                                                 BLOCK=RESOLVE_BLOCK, ROWS=slots is not None)
    return ids
