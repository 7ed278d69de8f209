"""Registers and spills of row kernels at a split layout, from `ptxas -v` on their
sm_90 code (no GPU needed; run from the repository root without TRITON_INTERPRET):
`python docs/scripts/row_registers.py`. It found layernorm's split backward spilling at
16384-wide parts (issue 30, docs/benchmarks.md "Wide rows")."""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

sys.path.insert(0, "tests")
import sm90_compile  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def registers(name: str, which: str, block_n: int, splits: int, warps=(8, 16, 32)) -> str:
    """`which` kernel ("forward" or "backward") of generated/<name>.py, fp32, every gradient
    asked ([N] ones summed over rows), one row a program."""
    module = sm90_compile.load_module(Path("generated") / f"{name}.py")
    kernel = getattr(module, f"{name}_kernel" if which == "forward" else f"{name}_backward_kernel")
    kernel = kernel.fn if isinstance(kernel, Autotuner) else kernel
    scalars = {p.name: sm90_compile._TRITON_SCALARS[p.type] for p in module._OP.params if hasattr(p, "type")}
    settings = {"COMPUTE_FP64": False, "HAS_DROPOUT": False, "needs": True, "rows": True, "cols": False,
                "SPLITS": splits, "ONE_TILE": True}
    signature, constexprs = sm90_compile.signature(kernel, "fp32", scalars, settings)
    constexprs.update({key: value for key, value in dict(BLOCK_N=block_n, BLOCK_M=1, ROWS_PER_PROGRAM=1,
                                                         SUM_GRAD_X=False).items() if key in constexprs})
    found = []
    for count in warps:
        compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs),
                                  target=sm90_compile.H100, options={"num_warps": count})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as ptx:
            ptx.write(compiled.asm["ptx"])
        done = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx.name, "-o", os.devnull],
                              capture_output=True, text=True)
        os.unlink(ptx.name)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas failed on {name}'s {which}: {done.stderr[-500:]}")
        report = done.stderr
        registers = re.search(r"Used (\d+) registers", report).group(1)
        spills = re.search(r"(\d+) bytes spill stores", report).group(1)
        found.append(f"{count} warps: {registers} registers, {spills} B spilled")
    return f"{name} {which}, {splits} parts of {block_n}: " + "; ".join(found)


if __name__ == "__main__":
    for which in ("forward", "backward"):
        for name in ("softmax", "rmsnorm", "layernorm"):
            for block_n, splits in ((32768, 8), (16384, 16), (8192, 32)):
                print(registers(name, which, block_n, splits), flush=True)
