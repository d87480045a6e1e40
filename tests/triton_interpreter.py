"""Running the Triton kernels on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1), for the
kernel tests.

`run_script(source, tmp_path)` runs a test script in a fresh interpreter process (the variable must be set
before Triton is imported) and checks that it printed "interpreter ok". Importing this module inside such a
script patches Triton 3.6's interpreter, test-side only: loop bounds are 1-element arrays, which int() no
longer takes (numpy >= 2.4); tl.dot multiplies bfloat16 tiles as raw 16-bit patterns; and float32 -> fp8e4nv
rounds without carrying into the exponent (127 becomes 64). The GPU's conversion rounds to nearest even, as
torch does.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(source: str, tmp_path: Path) -> None:
    script = tmp_path / "interpret.py"
    script.write_text(source)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stderr[-5000:]


if os.environ.get("TRITON_INTERPRET"):
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as ti

    _patch = ti._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = _patch_lang_tensor
    _dot = ti.InterpreterBuilder.create_dot

    def _create_dot(self, a, b, d, *args):
        def f32(h):
            if h.dtype == tl.bfloat16:
                return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h
        return _dot(self, f32(a), f32(b), d, *args)

    ti.InterpreterBuilder.create_dot = _create_dot
    _fp_to_fp = ti.InterpreterBuilder.create_fp_to_fp

    def _create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            fp8 = torch.from_numpy(src.data.astype(np.float32)).to(torch.float8_e4m3fn)
            data = fp8.view(torch.uint8).numpy()
            return ti.TensorHandle(data, dst_type.scalar)
        return _fp_to_fp(self, src, dst_type, rounding_mode)

    ti.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp
