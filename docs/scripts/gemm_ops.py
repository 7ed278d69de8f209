"""Issue 32: a generated gemm op against what a user would run instead, bf16 on the GPU: the
bare GEMM (torch.mm), eager PyTorch (F.linear, the epilogue's ops), torch.compile of that eager
code (default and mode="max-autotune-no-cudagraphs"); forward and forward+backward, ms by
triton.testing.do_bench. The op is built from its spec into a temporary folder; with --pointer
a second build of it, made to take the pointer mainloop (no TMA), is timed beside it.
`python docs/scripts/gemm_ops.py [--shapes 16384x4096x4096,...] [--compile default,...] [--pointer]
[--json FILE]` (M x K x N)."""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import build_and_import  # noqa: E402

SPEC = """\
name: linear_gelu_add
doc: y = gelu_tanh(x @ T(weight) + bias) + residual
inputs: {x: [..., K], weight: [N, K], bias: [N], residual: [..., N]}
outputs: {y: gelu_tanh(x @ T(weight) + bias) + residual}
"""

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="16384x4096x4096,16384x4096x11008")
parser.add_argument("--json", default=None)
parser.add_argument("--compile", default="default,max-autotune-no-cudagraphs",
                    help="torch.compile modes to time, comma-separated ('' for none)")
parser.add_argument("--pointer", action="store_true", help="also the op with the pointer mainloop")
options = parser.parse_args()


def eager(x, weight, bias, residual):
    return F.gelu(F.linear(x, weight, bias), approximate="tanh") + residual


def bench(fn, inputs, grad):
    forward = triton.testing.do_bench(lambda: fn(*inputs), warmup=25, rep=100)

    def step():
        fn(*inputs).backward(grad)
    both = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=inputs)
    return forward, both


op = build_and_import(Path(tempfile.mkdtemp()), SPEC).linear_gelu_add
pointer_op = None
if options.pointer:  # its own op name (one torch.library registration each); its launches never take TMA
    from fusegen.backends.triton import gemm_launch

    pointer_op = build_and_import(Path(tempfile.mkdtemp()), SPEC.replace("linear_gelu_add", "linear_gelu_add_pointer"))
    pointer_op = pointer_op.linear_gelu_add_pointer
    tma_layouts = gemm_launch.gemm_lib.tma_layouts

    def take_pointer(fn):
        def call(*args):
            gemm_launch.gemm_lib.tma_layouts = lambda a, b: None
            try:
                return fn(*args)
            finally:
                gemm_launch.gemm_lib.tma_layouts = tma_layouts
        return call
    pointer_op = take_pointer(pointer_op)
rows = []
for shape in options.shapes.split(","):
    m, k, n = map(int, shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).requires_grad_()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs = [x, weight, bias, residual]
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        truth = eager(*[t.double() for t in inputs])
        err = lambda y: ((y.double() - truth).norm() / truth.norm()).item()  # noqa: E731
        row = {"shape": [m, k, n], "err_fused": err(op(*inputs)), "err_eager": err(eager(*inputs))}
    mm_in = x.detach(), weight.detach().t()
    row["mm"] = triton.testing.do_bench(lambda: torch.mm(*mm_in), warmup=25, rep=100)
    row["fused"] = bench(op, inputs, grad)
    if pointer_op is not None:
        row["fused pointer"] = bench(pointer_op, inputs, grad)
        with torch.no_grad():
            row["err_fused_pointer"] = err(pointer_op(*inputs))
    row["eager"] = bench(eager, inputs, grad)
    for mode in filter(None, options.compile.split(",")):
        torch._dynamo.reset()
        try:
            row[f"compile {mode}"] = bench(torch.compile(eager, mode=None if mode == "default" else mode), inputs, grad)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            row[f"compile {mode}"] = str(exc)[:120]
    rows.append(row)
    fmt = lambda v: f"{v[0]:.4f}/{v[1]:.4f}" if isinstance(v, tuple) else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    print(f"{m}x{k}x{n} | " + " | ".join(f"{key} {fmt(value)}" for key, value in row.items() if key != "shape"), flush=True)
    del x, weight, bias, residual, inputs, grad, truth
    torch.cuda.empty_cache()
if options.json:
    json.dump(rows, open(options.json, "w"), indent=1)
