"""Compile generated kernels for an H100 (sm_90) through Triton's real compiler, on a machine
with no GPU: `python tests/sm90_compile.py generated/gelu.py ...`.

The interpreter runs a kernel's Python; this runs the code generator, the MLIR passes,
LLVM and ptxas, which the interpreter never does: libdevice overloads, fp32-only `tl`
functions, and constructs the compiler rejects fail here as they would on the GPU.
Every kernel compiles for each combination of its choices, in fp32, bf16, fp16 and fp64,
with and without dropout, each way of writing gradients, and 64-bit indexing.

Must run without TRITON_INTERPRET (the test runs it in a subprocess): under the interpreter,
`@triton.jit` makes interpreter functions that the compiler cannot take. Prints one line per
failure and exits 1 if any.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import os
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

H100 = GPUTarget("cuda", 90, 32)
_TRITON_SCALARS = {"float": "fp32", "int": "i32"}  # how the launcher's Python scalars arrive


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(choices: dict[str, tuple]) -> list[tuple[str, dict]]:
    """(pointer type, constexprs) to compile: every choice combination in fp64 (the dtype
    the interpreter checks least), the first combination in every dtype, and each way the
    backward writes a gradient: in full, as column sums (SUM_GRAD), as row sums (SUM_COLS_GRAD)."""
    combos = [dict(zip(choices, values)) for values in itertools.product(*choices.values())] or [{}]
    sums = {"needs": True, "rows": True, "cols": False}
    out = [("fp64", {**combo, "COMPUTE_FP64": True, "HAS_DROPOUT": True, **sums}) for combo in combos]
    for dtype in ("fp32", "bf16", "fp16"):
        for dropout in (True, False):
            out.append((dtype, {**combos[0], "COMPUTE_FP64": False, "HAS_DROPOUT": dropout, **sums}))
        for gradients in ({"rows": False, "cols": False}, {"rows": False, "cols": True}, {"needs": False}):
            out.append((dtype, {**combos[0], "COMPUTE_FP64": False, "HAS_DROPOUT": True, **sums, **gradients}))
    out.append(("fp32", {**combos[0], "COMPUTE_FP64": False, "HAS_DROPOUT": True, **sums, "INDEX_64": True}))
    # Dropout's per-element path (N % 4 != 0), with 32- and 64-bit indices.
    for index_64 in (False, True):
        out.append(("bf16", {**combos[0], "COMPUTE_FP64": False, "HAS_DROPOUT": True, **sums, "INDEX_64": index_64,
                             "WHOLE_GROUPS": False}))
    # A DTensor's shard: masks keyed by the global index, both dropout paths.
    for whole_groups in (True, False):
        out.append(("bf16", {**combos[0], "COMPUTE_FP64": False, "HAS_DROPOUT": True, **sums, "SHARDED": True,
                             "WHOLE_GROUPS": whole_groups}))
    return out


def signature(kernel, pointer: str, scalar_types: dict[str, str], settings: dict,
              integer_inputs: dict[str, str] | None = None) -> tuple[dict, dict]:
    integer_inputs = integer_inputs or {}
    sig, constexprs = {}, {}
    names = {param.name for param in kernel.params}
    # The gradients the kernel writes; an incoming output gradient (grad_y) has strides.
    written_gradients = {n for n in names if n.startswith("grad_") and n.endswith("_ptr") and f"{n[:-4]}_stride_m" not in names}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
            if name in ("BLOCK_M", "ROWS_PER_PROGRAM"):
                # A gemm kernel's tl.dot takes tiles of 16 and more a side.
                constexprs[name] = (64 if "BLOCK_K" in names else 2) if name == "BLOCK_M" else 4
            elif name == "BLOCK_R":  # a low-rank product's rank, rounded up (LoRA's r = 16)
                constexprs[name] = 16
            elif name == "BLOCK_H":  # a hidden layer's width, rounded up (a DLRM top MLP's 256)
                constexprs[name] = 256
            elif name in ("BLOCK_K", "GROUP_M"):  # the gemm kind's (gemm_tuning)
                constexprs[name] = 64 if name == "BLOCK_K" else 8
            elif name == "PARTS":  # the gemm epilogue's halves, with TMA (one tile's worth otherwise)
                constexprs[name] = 2 if settings.get("TMA") else 1
            elif name == "INPUT_PRECISION":
                constexprs[name] = "ieee"
            elif name == "FP64_PRODUCT":
                constexprs[name] = settings["COMPUTE_FP64"]
            elif name == "KEEP":  # a gemm forward that keeps the product (or not: no gradient follows)
                constexprs[name] = settings.get("KEEP", True)
            elif name == "TMA":  # a gemm forward's descriptor mainloop (never for fp64: gemm_lib.tma_layouts)
                constexprs[name] = settings.get("TMA", False)
            elif name in ("A_K_MAJOR", "B_K_MAJOR"):  # row-major x, nn.Linear's weight
                constexprs[name] = True
            elif name == "BLOCK_N":
                constexprs[name] = 128
            elif name in settings:
                constexprs[name] = settings[name]
            elif name == "INDEX_64":
                constexprs[name] = settings.get("INDEX_64", False)
            elif name == "ONE_TILE":
                constexprs[name] = settings.get("ONE_TILE", True)
            elif name == "SPLITS":  # a row forward split across programs (or not)
                constexprs[name] = settings.get("SPLITS", 1)
            elif name == "SHARES":  # the split's exchange: its values a round (any count compiles alike)
                constexprs[name] = 2
            elif name == "ONLINE":  # looped forwards with online sums: both forms
                constexprs[name] = settings.get("ONLINE", True)
            elif name == "DROPOUT_WHOLE_GROUPS":
                constexprs[name] = settings.get("WHOLE_GROUPS", True)
            elif name == "SHARDED":
                constexprs[name] = settings.get("SHARDED", False)
            elif name.startswith("NEEDS_GRAD_"):
                constexprs[name] = settings["needs"]
            elif name.startswith("SUM_GRAD_"):
                constexprs[name] = settings["rows"]
            elif name.startswith("SUM_COLS_GRAD_"):
                constexprs[name] = settings["cols"]
            else:
                raise ValueError(f"{name}: a constexpr this script does not know")
        elif name in written_gradients and (settings["rows"] or settings["cols"]):
            # Gradient sums are buffers in the accumulation type (an input's own gradient
            # may be written in full, in its dtype, when only the other flag applies).
            sig[name] = "*fp64" if settings["COMPUTE_FP64"] else "*fp32"
        elif name == "exchange_ptr" and settings.get("SPLITS", 1) == 1:  # no split: None, as the launcher passes it
            sig[name] = "constexpr"
            constexprs[name] = None
        elif name in ("statistics_ptr", "exchange_ptr"):  # a row op's per-row statistics, a split's exchange: in the compute type, as the runtime keeps them
            sig[name] = "*fp64" if settings["COMPUTE_FP64"] else "*fp32"
        elif name in ("seed_ptr", "shard_ptr"):  # dropout's seed, and a shard's place: int64s on the device
            sig[name] = "*i64"
        elif name.endswith("_ptr") and name[:-4] in integer_inputs:  # a target, a mask: its own type
            sig[name] = {"int64": "*i64", "int32": "*i32", "bool": "*i1"}[integer_inputs[name[:-4]]]
        elif name.endswith("_ptr"):
            sig[name] = f"*{pointer}"
        elif name.startswith("dropout_scale"):
            sig[name] = "fp32"
        elif name in scalar_types:
            sig[name] = scalar_types[name]
        else:  # M, N, strides, dropout thresholds
            sig[name] = "i64" if settings.get("INDEX_64") else "i32"
    return sig, constexprs


def compile_module(path: Path) -> list[str]:
    module = load_module(path)
    op = module._OP.name
    # The op's declaration says each param's kind; kernels name them as the spec does, and a
    # choice as its upper-cased constexpr (for these specs: none collides with another name).
    scalar_types = {p.name: _TRITON_SCALARS[p.type] for p in module._OP.params if hasattr(p, "type")}
    choices = {p.name.upper(): p.choices for p in module._OP.params if hasattr(p, "choices")}
    failures = []
    # A forward-only op (float8 outputs) has no backward kernel.
    for kernel_name in (f"{op}_kernel", f"{op}_backward_kernel")[:1 if module._OP._forward_only else 2]:
        kernel = getattr(module, kernel_name)
        kernel = kernel.fn if isinstance(kernel, Autotuner) else kernel
        cases = variants(choices)
        if any(p.name == "ONE_TILE" for p in kernel.params):
            # Row kernels: the looped layout too, with each way of writing gradients.
            looped = [(pointer, {**settings, "ONE_TILE": False}) for pointer, settings in cases if pointer != "fp16"]
            if any(p.name == "ONLINE" for p in kernel.params):
                looped += [(pointer, {**settings, "ONLINE": False}) for pointer, settings in looped]
            if any(p.name == "SPLITS" for p in kernel.params):  # a forward: its row split, too
                looped += [(pointer, {**settings, "SPLITS": 4}) for pointer, settings in cases if pointer != "fp16"]
            cases += looped
        if any(p.name == "TMA" for p in kernel.params):  # a gemm forward: the descriptor mainloop too
            cases += [(pointer, {**settings, "TMA": True}) for pointer, settings in cases if pointer != "fp64"]
        if any(p.name == "KEEP" for p in kernel.params):  # and the forward that keeps nothing, in fp32
            cases += [(pointer, {**settings, "KEEP": False}) for pointer, settings in cases[:1]]
        for pointer, settings in cases:
            integer_inputs = {i.name: i.dtype for i in module._OP.inputs if getattr(i, "dtype", "float") != "float"}
            sig, constexprs = signature(kernel, pointer, scalar_types, settings, integer_inputs)
            try:
                triton.compile(ASTSource(kernel, signature=sig, constexprs=constexprs), target=H100)
            except Exception as exc:  # noqa: BLE001 - reported, one line per variant
                cause = exc.__cause__ or exc  # a CompilationError carries the source; its cause says why
                message = " ".join(str(cause).split())[:300]
                failures.append(f"{path}: {kernel_name} {pointer} {constexprs}: {type(cause).__name__}: {message}")
    return failures


def main(paths: list[str]) -> int:
    if not paths:
        print("no modules given")
        return 1
    # The largest modules (the most variants) first, so that the pool's last ones are short.
    order = sorted(map(Path, paths), key=lambda path: -path.stat().st_size)
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        found = dict(zip(order, pool.map(compile_module, order)))
    failures = [line for path in map(Path, paths) for line in found[path]]
    print("\n".join(failures) or f"{len(paths)} modules compiled for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
