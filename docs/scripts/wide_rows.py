"""Wide rows (issue 30): fusegen's row ops against a copy of the same bytes, torch.compile and
Liger-Kernel (where installed and where it runs), forward and forward+backward, ms by
triton.testing.do_bench; with `--old DIR`, also a folder of generated modules from another
commit (an A/B in one process). `python docs/scripts/wide_rows.py [--ops softmax,...] [--old DIR] [--json FILE]`."""
import json, os, sys
from pathlib import Path
import torch, triton
import torch.nn.functional as F
from fusegen.backends.triton import layout_choice, row_tuning
from fusegen.bench.cases import load_bench_op

# Issue 30's shapes, for each of its ops.
CASES = [(name, dtype, m, n) for dtype, m, n in ((torch.float32, 1024, 65536), (torch.float32, 256, 262144),
                                                 (torch.bfloat16, 4096, 32768), (torch.bfloat16, 1024, 131072))
         for name in ("softmax", "log_softmax", "rmsnorm", "layernorm")]
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--ops", default=None)
parser.add_argument("--old", default=None, help="a folder of generated modules to A/B against")
parser.add_argument("--old-looped-backward", action="store_true",
                    help="the --old modules' backwards take the loop along the row (no row_tuning.SPLIT_BACKWARD)")
parser.add_argument("--shapes", default=None, help="only these, e.g. float32:1024x65536,bfloat16:1024x131072")
parser.add_argument("--json", default=None)
parser.add_argument("--old-looped", action="store_true",
                    help="the --old modules' forwards take the loop along the row where the split would run: "
                         "an A/B of the layouts (pass a copy of generated/ as --old)")
parser.add_argument("--old-rule", action="store_true",
                    help="the --old modules run the rule's layout, not the measured one (layout_choice.MEASURE off)")
parser.add_argument("--old-tuning", default=None,
                    help="row_tuning constants the --old modules run under, e.g. "
                         "'SPLIT_PART=(8192,16384);SPLIT_VALUES_BACKWARD=32768' (an A/B of the constants)")
options = parser.parse_args()
old_tuning = dict(item.split("=", 1) for item in options.old_tuning.split(";")) if options.old_tuning else {}
only = options.ops.split(",") if options.ops else None
try:
    from liger_kernel.ops.softmax import LigerSoftmaxFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    LIGER = {"softmax": lambda x, *w: LigerSoftmaxFunction.apply(x),
             "rmsnorm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "gemma", False),
             "layernorm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)}
except Exception as e:
    print("no liger", e); LIGER = {}
EAGER = {"softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, -1),
         "rmsnorm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
         "layernorm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)}
rows = []
def bench(fn, inputs, grad):
    f = triton.testing.do_bench(lambda: fn(*inputs), warmup=25, rep=100)
    def fb():
        y = fn(*inputs); y.backward(grad)
    b = triton.testing.do_bench(fb, warmup=25, rep=100, grad_to_none=inputs)
    return f, b
shapes = set(options.shapes.split(",")) if options.shapes else None
for name, dtype, m, n in CASES:
    if only and name not in only: continue
    if shapes and f"{str(dtype)[6:]}:{m}x{n}" not in shapes: continue
    new = load_bench_op(name, Path("specs"), Path("generated"))
    old = load_bench_op(name, Path("specs"), Path(options.old)) if options.old else None
    torch.manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    extra = {"softmax": [], "log_softmax": [], "rmsnorm": [torch.rand(n, device="cuda", dtype=dtype) + 0.5],
             "layernorm": [torch.rand(n, device="cuda", dtype=dtype) + 0.5, torch.randn(n, device="cuda", dtype=dtype)]}[name]
    inputs = [t.requires_grad_(True) for t in [x, *extra]]
    grad = torch.randn_like(x)
    y = torch.empty_like(x)
    copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100)
    r = {"op": name, "dtype": str(dtype)[6:], "shape": [m, n], "copy": copy}
    with torch.no_grad():
        want = EAGER[name](*[t.double() for t in inputs])
    for tag, fn in [("new", new.op)] + ([("old", old.op)] if old else []):
        # --old-looped: the old copy's calls are prepared (so their layouts chosen) with no split.
        layout = row_tuning.row_forward_layout
        if tag == "old" and options.old_looped:
            row_tuning.row_forward_layout = lambda n, *rest, **keywords: (row_tuning.row_block_n(n), 1)
        split_backward = row_tuning.SPLIT_BACKWARD
        row_tuning.SPLIT_BACKWARD = split_backward and not (tag == "old" and options.old_looped_backward)
        # Any --old-* A/B of the rules runs them unmeasured (measuring would time past them).
        layout_choice.MEASURE = not (tag == "old" and (options.old_rule or options.old_looped
                                                       or options.old_looped_backward or old_tuning))
        saved = {key: getattr(row_tuning, key) for key in old_tuning}
        if tag == "old":
            for key, value in old_tuning.items():
                setattr(row_tuning, key, eval(value))
        try:
            with torch.no_grad():
                got = fn(*inputs)
            r[tag + "_err"] = ((got.double() - want).abs().max() / want.abs().max()).item()
            r[tag] = bench(fn, inputs, grad)
        finally:
            row_tuning.row_forward_layout, row_tuning.SPLIT_BACKWARD = layout, split_backward
            layout_choice.MEASURE = True
            for key, value in saved.items():
                setattr(row_tuning, key, value)
    torch._dynamo.reset()
    try:
        r["compile"] = bench(torch.compile(EAGER[name]), inputs, grad)
    except Exception as e:
        r["compile"] = str(e)[:200]
    if name in LIGER:
        try:
            r["liger"] = bench(LIGER[name], inputs, grad)
        except Exception as e:
            r["liger"] = str(e)[:200]
    rows.append(r)
    fmt = lambda v: f"{v[0]:.4f}/{v[1]:.4f}" if isinstance(v, tuple) else str(v)[:60]
    print(f"{name} {r['dtype']} {m}x{n} copy {copy:.4f} | " + " | ".join(f"{k} {fmt(v)}" for k, v in r.items() if k not in ("op", "dtype", "shape", "copy")), flush=True)
    del x, inputs, grad, y
    torch.cuda.empty_cache()
for record in layout_choice.measured:  # each measured layout choice: the kernel, its shape, ms per layout
    print("layout", record["label"], record["layout"], " ".join(f"{tuple(k)}:{v:.4f}" for k, v in record["ms"]))
if options.json:
    json.dump(rows, open(options.json, "w"), indent=1)
