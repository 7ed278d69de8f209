"""Issue 33: shipped pointwise and row ops built by the CUDA backend against the same op built by the
Triton backend, in one run on the GPU: forward and forward+backward, ms (medians by `fusegen
bench`'s do_bench timer; before the twenty-first session's end, do_bench's default, the mean),
and each op's first use (NVRTC compiling its forward and backward with an empty cache, plus the
first launches). `python docs/scripts/cuda_backend.py [--ops gelu,...] [--cells bf16:16384x8192,...]`
(docs/benchmarks.md, "The CUDA backend")."""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from fusegen.bench.timing import time_fn  # noqa: E402
from tests.helpers import ShapeCase, build_and_import, make_inputs, op_by_name, params_for, shipped_as  # noqa: E402

OPS = ("add_relu", "bias_dropout_add", "bias_relu", "gelu", "gelu_tanh", "leaky_relu", "mish", "quick_gelu", "softcap",
       "squared_relu", "softmax", "log_softmax", "rmsnorm", "add_rmsnorm", "layernorm", "bias_layernorm",
       "layernorm_dropout_add")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _cuda_op(folder: Path, name: str):
    """The shipped spec `name` built by the CUDA backend as `<name>_cuda` (its library ops beside the
    Triton op's, not in their place), imported; built once."""
    if name not in _BUILT:
        _BUILT[name] = getattr(build_and_import(folder, shipped_as(name, f"{name}_cuda"), "cuda"), f"{name}_cuda")
    return _BUILT[name]


_BUILT: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--cells", default="bf16:16384x8192,fp32:16384x4096")
    args = parser.parse_args()
    os.environ["FUSEGEN_CACHE_DIR"] = tempfile.mkdtemp()  # the first use compiles
    folder = Path(tempfile.mkdtemp())
    print(torch.__version__, torch.cuda.get_device_name())
    for cell in args.cells.split(","):
        dtype_name, shape = cell.split(":")
        m, n = (int(s) for s in shape.split("x"))
        for name in args.ops.split(","):
            cuda_fn = _cuda_op(folder, name)
            op = op_by_name(name)
            kwargs = dict(params_for(op, p=0.1), **({"training": True} if op.has_dropout else {}))
            tensors = make_inputs(op, ShapeCase("big", (m,), n), DTYPES[dtype_name], device="cuda", seed=1)
            leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
            start = time.perf_counter()
            y = cuda_fn(*leaves.values(), **kwargs)
            torch.autograd.backward(y, torch.ones_like(y))
            torch.cuda.synchronize()
            row = [f"{name:17s} {dtype_name:5s} first use {time.perf_counter() - start:5.2f}s"]
            for label, fn in (("cuda", cuda_fn), ("triton", op.fn)):
                forward = time_fn(lambda: fn(*tensors.values(), **kwargs)).median_ms
                g = torch.ones_like(fn(*tensors.values(), **kwargs))

                def step():
                    torch.autograd.backward(fn(*leaves.values(), **kwargs), g)

                both = time_fn(step, grad_to_none=list(leaves.values())).median_ms
                row.append(f"{label} {forward:.4f}/{both:.4f}")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
