"""Programmatic dependent launch (kernels/__init__.py, `pdl`): each Triton kernel of the decode path that may
start before the kernel ahead of it has finished still reads that kernel's output, never what was there before
it.

A producer kernel lets the next kernel start at once and writes that kernel's input only 20 ms later; each
kernel's result must equal its result on the same input written beforehand. The GEMV launched early without
its wait reads the old input, so the check can fail. The delay is long so that the next kernel is queued
before the input is written even when the host is slow to launch it: with 200 us, that control check can
pass late in a full GPU run.

Marker `gpu`; skipped without CUDA, and on GPUs older than sm_90 (no programmatic dependent launch there).
"""
from __future__ import annotations

import gc

import pytest
import torch

from gpu_helpers import BF16, DEV, HAS_CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

if HAS_CUDA:
    import triton
    import triton.language as tl

    @triton.jit
    def _late_copy_kernel(src_ptr, dst_ptr, n, delay_ns, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start now
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                       is_pure=False, pack=1)
        t = t0
        while t - t0 < delay_ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                          is_pure=False, pack=1)
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)
        tl.extra.cuda.gdc_wait()  # a copy launched early after another one finishes after it


def late_copy(dst: torch.Tensor, src: torch.Tensor, delay_us: int = 20_000) -> None:
    """dst <- src (contiguous, same shape), written `delay_us` after the copy starts; the kernel launched
    after it on the stream may start at once."""
    d, s = dst.view(-1).view(torch.uint8), src.reshape(-1).contiguous().view(torch.uint8)
    _late_copy_kernel[(1,)](s, d, d.numel(), delay_us * 1000, BLOCK=1024, launch_pdl=True)


def reads_late_input(kernel_call, inputs: list[torch.Tensor]) -> None:
    """kernel_call() reads `inputs`: its results with them written late (late_copy) equal its results with
    them written beforehand."""
    new = [x.clone() for x in inputs]
    torch.cuda.synchronize()
    want = [r.clone() for r in kernel_call()]
    for x in inputs:
        x.zero_()
    torch.cuda.synchronize()
    gc.disable()  # no collection between the launches
    try:
        for x, v in zip(inputs, new):
            late_copy(x, v)
        got = kernel_call()
    finally:
        gc.enable()
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g, w), "a kernel read its input before the kernel writing it had finished"


@pytest.fixture(autouse=True)
def needs_sm90():
    from tp_engine import kernels
    if torch.cuda.get_device_capability(DEV) < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    assert kernels.pdl(DEV), "the kernels do not use programmatic dependent launch on this GPU"


def test_the_check_fails_for_a_kernel_that_does_not_wait():
    from tp_engine.kernels import gemv
    x = torch.randn(1, 4096, device=DEV).to(BF16)
    w = torch.randn(8192, 4096, device=DEV).to(BF16)
    out = torch.empty(1, 8192, device=DEV, dtype=BF16)

    def early():  # launched early, with its wait compiled out
        gemv._gemv_kernel[(8192 // 4,)](x, w, out, 8192, 4096, w.stride(0), BLOCK_N=4, BLOCK_K=512, PDL=False,
                                        num_warps=4, launch_pdl=True)
        return [out]
    with pytest.raises(AssertionError, match="before the kernel writing it"):
        reads_late_input(early, [x])


def test_matmul_and_norm_kernels_wait():
    from tp_engine.kernels import gemv, norm
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(1, 4096, device=DEV, generator=g).to(BF16)
    w = torch.randn(6144, 4096, device=DEV, generator=g).to(BF16)
    for cfg in gemv.GEMV_CONFIGS:
        reads_late_input(lambda: [gemv._gemv(x, w, cfg)], [x])
    res = torch.randn(3, 4096, device=DEV, generator=g).to(BF16)
    h = torch.randn(3, 4096, device=DEV, generator=g).to(BF16)
    nw = torch.rand(4096, device=DEV, generator=g).to(BF16)
    reads_late_input(lambda: norm.add_rmsnorm(h, res, nw, 1e-6), [h, res])
    gu = torch.randn(3, 2 * 3072, device=DEV, generator=g).to(BF16)
    reads_late_input(lambda: [norm.silu_mul(gu)], [gu])


def test_qk_norm_rope_store_waits():
    from tp_engine.kernels import norm
    g = torch.Generator(device=DEV).manual_seed(1)
    heads, kv, d, page = 8, 2, 128, 16
    qkv = torch.randn(3, (heads + 2 * kv) * d, device=DEV, generator=g).to(BF16)
    qw, kw = torch.rand(d, device=DEV, generator=g).to(BF16), torch.rand(d, device=DEV, generator=g).to(BF16)
    cos, sin = torch.rand(64, d, device=DEV, generator=g), torch.rand(64, d, device=DEV, generator=g)
    pos = torch.tensor([5, 17, 40], device=DEV)
    rows = torch.tensor([0, 33, 70], device=DEV)  # slots in pages 0, 1 and 2
    cache = torch.zeros(4, 2, page, kv, d, device=DEV, dtype=BF16)
    reads_late_input(lambda: [norm.qk_norm_rope_store(qkv, qw, kw, 1e-6, cos, sin, pos, rows, cache, heads,
                                                      kv, d, page), cache], [qkv, pos])


def test_decode_attention_waits():
    """The graphs' decode attention reads its page table (filled before the step) and starts its K and V rows
    into the L2 cache before its wait; q and the cache, which the kernel before writes (the newest token's K
    and V), it reads after. 200 tokens: two programs per KV head and their merge."""
    from tp_engine.kernels import decode_attention as da
    g = torch.Generator(device=DEV).manual_seed(4)
    heads, kv, d, page, n = 32, 8, 128, 16, 200
    pages = -(-n // page)
    cache = torch.randn(pages + 1, 2, page, kv, d, device=DEV, generator=g).to(BF16)
    ids = torch.arange(pages, 0, -1, dtype=torch.int32, device=DEV)  # out of order, page 0 unused
    indptr = torch.tensor([0, pages], dtype=torch.int32, device=DEV)
    last = torch.tensor([n - (pages - 1) * page], dtype=torch.int32, device=DEV)
    q = torch.randn(1, heads, d, device=DEV, generator=g).to(BF16)
    dec = da.PagedDecode(indptr, last, ids, heads, kv, d, page)
    reads_late_input(lambda: [dec.run(q, cache)], [q, cache])


@pytest.mark.parametrize("fp8", [False, True])
def test_fp8_and_moe_kernels_wait(fp8):
    from tp_engine.kernels import fp8 as fp8_kernels
    from tp_engine.kernels import moe
    from tp_engine.kernels.moe_grouped import ExpertScales
    g = torch.Generator(device=DEV).manual_seed(2)
    e, h, i, k = 16, 1024, 768, 4
    x = torch.randn(2, h, device=DEV, generator=g).to(BF16)
    logits = torch.randn(2, e, device=DEV, generator=g).to(BF16)
    reads_late_input(lambda: moe.topk_softmax(logits, k, True), [logits])
    weights, ids = moe.topk_softmax(logits, k, True)
    scales = None
    gate_up = torch.randn(e, 2 * i, h, device=DEV, generator=g).to(BF16) * 0.05
    down = torch.randn(e, h, i, device=DEV, generator=g).to(BF16) * 0.05
    if fp8:
        rows = lambda n: (torch.arange(n, device=DEV) // 128).to(torch.int32)  # noqa: E731
        gate_up, down = (t.float().mul(2000).clamp(-448, 448).to(torch.float8_e4m3fn)
                         for t in (gate_up, down))
        scales = ExpertScales(torch.full((e, 2 * i // 128, h // 128), 1 / 2000, device=DEV), rows(2 * i),
                              torch.full((e, h // 128, i // 128), 1 / 2000, device=DEV), rows(h), 0, 128)
        w8 = torch.randn(640, h, device=DEV, generator=g).mul(100).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.rand(5, h // 128, device=DEV, generator=g)
        for cfg in fp8_kernels.GEMV_CONFIGS:
            reads_late_input(lambda: [fp8_kernels.gemv(x[:1], w8, ws, rows(640), 0, 128, cfg)], [x])
    reads_late_input(lambda: [moe.moe_gemv(x, gate_up, down, weights, ids, scales)], [x, weights, ids])
