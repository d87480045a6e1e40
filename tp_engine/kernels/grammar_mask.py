"""Grammar masks onto the logits, in one kernel: each row's allowed tokens kept, the others -inf; and the
kernel that holds a stream until the host has filled them (sampling/grammar_masks.py)."""
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


    @triton.jit(do_not_specialize=["target"])
    def _wait_kernel(flag_ptr, target):
        """Return once the int32 at flag_ptr (pinned host memory, read over the bus) reaches target."""
        seen = tl.load(flag_ptr, volatile=True)
        while seen < target:
            seen = tl.load(flag_ptr, volatile=True)


MASK_BLOCK = 4096


def wait_for_host(flag: torch.Tensor, target: int) -> None:
    """Hold the current stream until flag[0] >= target: flag is a pinned host int32 tensor that a host
    thread raises. The work queued behind this waits on the GPU; the host goes on at once."""
    assert flag.is_pinned() and flag.dtype == torch.int32
    _wait_kernel[(1,)](flag, target, num_warps=1)


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
