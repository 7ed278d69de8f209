"""A/B of generated kernels in one process: this checkout's generated/ against a folder of
generated modules from another commit (`git archive <commit> generated | tar -x -C /tmp/old`,
then `--old /tmp/old/generated`), forward and forward+backward by triton.testing.do_bench,
min of two interleaved rounds, and whether the outputs and gradients are bit-identical.
`python docs/scripts/kernels_ab.py --old DIR layernorm,rmsnorm,... [--cells fp32:1x16384x4096,...]`"""
import json, os, sys
from pathlib import Path
import torch, triton
from fusegen.bench.cases import bench_output_shapes, load_bench_op, make_inputs, op_kwargs

import argparse
parser = argparse.ArgumentParser()
parser.add_argument("ops")
parser.add_argument("--old", required=True)
parser.add_argument("--json", default=None)
parser.add_argument("--cells", default="bf16:1x16384x8192,bf16:1x4096x4096", help="dtype:BxSxH, comma-separated")
options = parser.parse_args()
OPS = options.ops.split(",")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = [(DTYPES[c.split(":")[0]], tuple(int(d) for d in c.split(":")[1].split("x"))) for c in options.cells.split(",")]
rows = []
for name in OPS:
    new = load_bench_op(name, Path("specs"), Path("generated"))
    old = load_bench_op(name, Path("specs"), Path(options.old))
    for dtype, bsh in SHAPES:
        torch.manual_seed(0)
        inputs = [t.requires_grad_(t.is_floating_point()) for t in make_inputs(new.spec, bsh, dtype, "cuda")]
        floats = [t for t in inputs if t.requires_grad]  # a class index has no gradient
        kw = op_kwargs(new, 0.1)
        gouts = [torch.randn(shape, dtype=dtype, device="cuda") for shape in bench_output_shapes(new, bsh)]
        def fwd(op): return lambda: op(*inputs, **kw)
        def fb(op):
            def step():
                outs = op(*inputs, **kw); outs = outs if isinstance(outs, (tuple, list)) else (outs,)
                torch.autograd.backward(outs, gouts)
            return step
        res = {}
        outs = {}
        for tag, b in (("new", new), ("old", old)):
            o = b.op(*inputs, **kw); o = o if isinstance(o, (tuple, list)) else (o,)
            g = torch.autograd.grad(o, floats, gouts)
            outs[tag] = [t.detach() for t in o] + list(g)
        same = all(torch.equal(a, b) for a, b in zip(outs["new"], outs["old"]))
        for rep in range(2):
            for tag, b in (("new", new), ("old", old)):
                f = triton.testing.do_bench(fwd(b.op), warmup=25, rep=100)
                fbt = triton.testing.do_bench(fb(b.op), warmup=25, rep=100, grad_to_none=floats)
                res.setdefault(tag, []).append((f, fbt))
        r = {"op": name, "dtype": str(dtype), "shape": bsh, "bit_identical": same}
        for tag in ("new", "old"):
            r[tag + "_fwd"] = min(x[0] for x in res[tag]); r[tag + "_fb"] = min(x[1] for x in res[tag])
        r["fwd_new_over_old"] = r["old_fwd"] / r["new_fwd"]; r["fb_new_over_old"] = r["old_fb"] / r["new_fb"]
        rows.append(r)
        print(f"{name:32s} {str(dtype)[6:]:9s} {bsh[1]}x{bsh[2]:<6d} same={same!s:5s} fwd new {r['new_fwd']:.4f} old {r['old_fwd']:.4f} ({r['fwd_new_over_old']:.3f}x)  fwd+bwd new {r['new_fb']:.4f} old {r['old_fb']:.4f} ({r['fb_new_over_old']:.3f}x)", flush=True)
        del inputs, gouts, outs
        torch.cuda.empty_cache()
if options.json:
    json.dump(rows, open(options.json, "w"), indent=1)
