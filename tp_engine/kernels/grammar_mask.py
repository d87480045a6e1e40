"""Grammar masks onto the logits, in one kernel: each row's allowed tokens kept, the others -inf."""
from __future__ import annotations

import torch

from tp_engine.kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _mask_logits_kernel(logits_ptr, out_ptr, masks_ptr, slots_ptr, stride, out_stride, vocab, words,
                            BLOCK: tl.constexpr):
        """Row r of the output: the logits where bit (id % 32) of word id // 32 of mask slots[r] is set, -inf
        elsewhere; slots[r] < 0: the row as it is."""
        r = tl.program_id(0).to(tl.int64)
        ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = ids < vocab
        x = tl.load(logits_ptr + r * stride + ids, mask=inside)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        if slot >= 0:
            w = ids >> 5
            bits = tl.load(masks_ptr + slot * words + w, mask=inside & (w < words), other=0)
            x = tl.where(((bits >> (ids & 31)) & 1) != 0, x, float("-inf"))
        tl.store(out_ptr + r * out_stride + ids, x, mask=inside)


MASK_BLOCK = 4096


def mask_logits(logits: torch.Tensor, masks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """sampling/grammar_masks.mask_logits on the device: logits [B, V] (float), masks [A, W] int32
    (contiguous), slots [B] int32 -> a new [B, V]."""
    b, v = logits.shape
    assert logits.stride(-1) == 1 and masks.is_contiguous() and slots.numel() == b
    out = torch.empty_like(logits)
    if b:
        _mask_logits_kernel[(b, triton.cdiv(v, MASK_BLOCK))](logits, out, masks, slots, logits.stride(0),
                                                             out.stride(0), v, masks.shape[-1],
                                                             BLOCK=MASK_BLOCK, num_warps=8)
    return out
