"""Issue 33: the CUDA backend's row ops at several layouts against the same op built by the Triton
backend, in one run on the GPU (ms, forward / forward+backward, and the Triton time over the CUDA
time), and each layout the launcher took (kernel, (threads, Items, cluster, registers) and grid).
A layout is `auto` (the launcher's own) or `forward share/backward share/part KB[/cluster
threads]`: the values of a row a thread takes in each kernel, each with `r` after it where a row
one block holds is kept in registers (row_launch.LAYOUTS, e.g. `16r/16`: for every dtype), a
cluster's block's shared memory at most (row_launch.PART) and its threads at most
(row_launch.CLUSTER_THREADS). `python docs/scripts/cuda_row_layouts.py OPS CELLS LAYOUTS
[--no-triton] [--device]`, e.g. `softmax,rmsnorm bf16:16384x8192,fp32:256x262144
32/16/64,16/16/64/1024` (docs/benchmarks.md, "The CUDA backend": the row tables came from this
script). Times are medians by `fusegen bench`'s timers (fusegen.bench.timing): do_bench's, or
with --device its device timer, which leaves the host's time out (the GPU waits on a sleep until
the call is queued). Before the twenty-first session's end the script took do_bench's default,
the mean, whose forward+backward times varied run to run by up to 1.5x. --no-triton leaves the
Triton op out, whose autotuning takes a minute or more at wide rows."""
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from fusegen.backends.cuda import row_launch  # noqa: E402
from fusegen.bench.timing import time_fn, time_fn_device  # noqa: E402
from tests.helpers import ShapeCase, build_and_import, make_inputs, op_by_name, params_for, shipped_as  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def times(fn, tensors: dict, kwargs: dict, device: bool = False) -> tuple[float, float]:
    """Forward, and forward+backward with every float input's gradient (medians, ms); `device`:
    the GPU's time alone (fusegen.bench.timing.time_fn_device)."""
    timer = time_fn_device if device else time_fn
    leaves = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    forward = timer(lambda: fn(*tensors.values(), **kwargs)).median_ms
    y = fn(*tensors.values(), **kwargs)
    grads = [torch.ones_like(t) for t in y] if isinstance(y, tuple) else [torch.ones_like(y)]
    both = timer(lambda: torch.autograd.backward(fn(*leaves.values(), **kwargs), grads),
                 grad_to_none=[v for v in leaves.values() if v.requires_grad]).median_ms
    return forward, both


def recorded(taken: list):
    """row_launch._RowLaunch.prepared, noting each new kernel's layout and grid in `taken`."""
    prepare = row_launch._RowLaunch.prepared

    def prepared(self, pack, index):
        new = (pack, index) not in self._kernels
        found = prepare(self, pack, index)
        if new:
            taken.append(f"{self._name}{self.layout(pack, index)[:4]}x{found[2]}")
        return found

    return prepared


def main() -> None:
    ops, cells, layouts = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3].split(",")
    with_triton, device = "--no-triton" not in sys.argv, "--device" in sys.argv
    launcher, taken = (row_launch.LAYOUTS, row_launch.PART, row_launch.CLUSTER_THREADS), []
    row_launch._RowLaunch.prepared = recorded(taken)
    os.environ["FUSEGEN_CACHE_DIR"] = tempfile.mkdtemp()
    folder = Path(tempfile.mkdtemp())
    print(torch.__version__, torch.cuda.get_device_name())
    for cell in cells:
        dtype, shape = cell.split(":")
        m, n = (int(s) for s in shape.split("x"))
        for name in ops:
            op = op_by_name(name)
            kwargs = dict(params_for(op, p=0.1), **({"training": True} if op.has_dropout else {}))
            tensors = make_inputs(op, ShapeCase("big", (m,), n), DTYPES[dtype], device="cuda", seed=1)
            triton_forward, triton_both = times(op.fn, tensors, kwargs, device) if with_triton else (float("nan"),) * 2
            line = [f"{name:22s} {cell:18s} triton {triton_forward:.4f}/{triton_both:.4f}"]
            for k, layout in enumerate(layouts):
                row_launch.LAYOUTS, row_launch.PART, row_launch.CLUSTER_THREADS = launcher
                if layout != "auto":
                    forward, backward, part, *threads = layout.split("/")
                    shares = tuple(((int(share.rstrip("r")),), share.endswith("r")) for share in (forward, backward))
                    row_launch.LAYOUTS = {size: shares for size in launcher[0]}
                    row_launch.PART = int(part) * 1024
                    row_launch.CLUSTER_THREADS = int(threads[0]) if threads else launcher[2]
                label = f"{name}_{cell.split(':')[0]}_{n}_v{k}"  # a module a cell and layout: layouts kept by call key
                fn = getattr(build_and_import(folder, shipped_as(name, label), "cuda"), label)
                forward, both = times(fn, tensors, kwargs, device)
                line.append(f"{layout} {forward:.4f}/{both:.4f} ({triton_forward / forward:.2f}/{triton_both / both:.2f}) "
                            + " ".join(taken))
                taken.clear()
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
