import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import pytest  # noqa: E402

# The longest tests (the kernels in Triton's interpreter, 20-45 s each) start first, so that neither worker of
# pytest -n 2 is left running one of them alone at the end.
FIRST = ("test_moe_kernels.py", "test_fp8_kernels.py", "test_mlp_kernel.py", "test_sampling_kernels.py")
# A GPU test's limit, not pyproject.toml's `timeout`: flashinfer and Triton compile kernels on first use.
GPU_TIMEOUT = 1200


def pytest_configure(config) -> None:
    """Under pytest -n N each worker gets its share of the cores for torch's threads, in this process and the
    ones it starts: with more threads than its share, an in-process test waits on threads the other worker's
    load deschedules (a test of 10 s alone takes over 100 s beside another worker)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        share = str(max(1, len(os.sched_getaffinity(0)) // workers))
        os.environ["OMP_NUM_THREADS"] = share
        import torch
        torch.set_num_threads(int(share))


def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: Path(str(item.fspath)).name not in FIRST)  # stable: otherwise the file order
    for item in items:
        if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(GPU_TIMEOUT))


# The GPU tests' checkpoint and reference, shared by test_gpu*.py (here, so that a session trains it once).
@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """A 2-layer Qwen3 (4 query heads, 2 KV heads, head_dim 128) that knows gpu_helpers.SEQUENCES; bf16."""
    from gpu_helpers import tiny_memorized
    return tiny_memorized(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def hf_ref(tiny_ckpt):
    """transformers on the same checkpoint in fp32 (bf16 weights, fp32 arithmetic): the judge of near ties."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpu_helpers import DEV
    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).to(DEV).eval()
