"""Compiling the Triton kernels for the H200 (sm_90) without a GPU, for the kernel tests: Triton's own ptxas,
cuobjdump and nvdisasm do it on any machine."""
import re
import subprocess
import tempfile
from pathlib import Path

import triton

MAX_SHARED = 227 * 1024  # dynamic shared memory per block on H100/H200


def compile_sm90(fn, types: dict, consts: dict, warps: int = 4, stages: int = 3, unaligned: tuple = ()):
    """Compile as a launch on the public shapes would: every argument but `unaligned` (sizes that need not be
    multiples of 16) marked 16-divisible, the JIT's specialisation, so loads vectorise and loops pipeline as
    on the GPU. types: the pointer arguments' types (the rest are i32)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: types.get(name, "i32") for name in fn.arg_names if name not in consts}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in sig if name not in unaligned}
    sig.update({name: "constexpr" for name in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def cuda_tool(name: str, args: list[str], cubin: bytes) -> str | None:
    """The output of Triton's own copy of a CUDA binary tool (cuobjdump, nvdisasm) on `cubin`; None
    without it."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not tool.is_file():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), *args, f.name], capture_output=True, text=True, check=True).stdout


def spills(kernel) -> str | None:
    """'STACK:n LOCAL:n' from cuobjdump's resource usage of the kernel's cubin, if cuobjdump is at hand."""
    out = cuda_tool("cuobjdump", ["-res-usage"], kernel.asm["cubin"])
    if out is None:
        return None
    usage = next(line for line in out.splitlines() if "REG:" in line)
    return " ".join(w for w in usage.split() if w.startswith(("STACK:", "LOCAL:")))


def loop_body(cubin: bytes) -> list[str] | None:
    """The SASS instructions of the kernel's longest loop, from the target of its backward branch to the
    branch, each as its opcode (the predicate dropped); None without nvdisasm."""
    out = cuda_tool("nvdisasm", ["-c"], cubin)
    if out is None:
        return None
    lines = out.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    start, end = max(loops, key=lambda se: se[1] - se[0])
    body = [line.split("*/", 1)[1].strip() for line in lines[start:end + 1]
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    return [line.split()[1] if line.startswith("@") else line.split()[0] for line in body]
