"""Whether a change to the kernel text changed the kernels, on a machine with no GPU: compiles
every variant that tests/sm90_compile.py compiles (each choice, dtype, dropout, gradient
flags, 64-bit indexing, both row layouts and both looped forms) of this checkout's generated
modules and of another commit's for sm_90, and compares the PTX with line info off. The same
PTX is the same kernel: same results, bit for bit, and the same speed.

    git archive <commit> generated | tar -x -C /tmp/old
    python docs/scripts/kernels_ptx_ab.py --old /tmp/old/generated softmax,layernorm,...
"""
import argparse
import concurrent.futures
import os
import sys
from pathlib import Path

os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

import sm90_compile  # noqa: E402


def ptx_of(path: Path) -> dict:
    """Each kernel variant's PTX, without its debug lines and comments."""
    module = sm90_compile.load_module(path)
    op = module._OP.name
    scalar_types = {p.name: sm90_compile._TRITON_SCALARS[p.kind] for p in module._OP.params if hasattr(p, "kind")}
    choices = {p.name.upper(): p.choices for p in module._OP.params if hasattr(p, "choices")}
    out = {}
    for kernel_name in (f"{op}_kernel", f"{op}_backward_kernel"):
        kernel = getattr(module, kernel_name)
        kernel = kernel.fn if isinstance(kernel, Autotuner) else kernel
        cases = sm90_compile.variants(choices)
        if any(p.name == "ONE_TILE" for p in kernel.params):
            looped = [(pointer, {**settings, "ONE_TILE": False}) for pointer, settings in cases if pointer != "fp16"]
            if any(p.name == "ONLINE" for p in kernel.params):
                looped += [(pointer, {**settings, "ONLINE": False}) for pointer, settings in looped]
            cases += looped
        for pointer, settings in cases:
            sig, constexprs = sm90_compile.signature(kernel, pointer, scalar_types, settings)
            ptx = triton.compile(ASTSource(kernel, signature=sig, constexprs=constexprs), target=sm90_compile.H100).asm["ptx"]
            lines = [line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file", "//"))]
            out[(kernel_name, pointer, str(sorted(constexprs.items())))] = "\n".join(lines)
    return out


def compare(old: Path, new: Path, op: str) -> tuple[str, int, list]:
    a, b = ptx_of(old / f"{op}.py"), ptx_of(new / f"{op}.py")
    return op, len(a), [key for key in a if a[key] != b.get(key)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ops")
    parser.add_argument("--old", required=True, type=Path)
    parser.add_argument("--new", default=ROOT / "generated", type=Path)
    options = parser.parse_args()
    ops = options.ops.split(",")
    differences = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(len(ops), os.cpu_count() or 1)) as pool:
        for op, count, differ in pool.map(compare, [options.old] * len(ops), [options.new] * len(ops), ops):
            print(f"{op:32s} {count:4d} variants, PTX differs in {len(differ)}", flush=True)
            for kernel_name, pointer, constexprs in differ[:3]:
                print(f"    {kernel_name} {pointer} {constexprs}")
            differences += len(differ)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
