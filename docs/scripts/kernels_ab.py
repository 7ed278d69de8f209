"""A/B of generated kernels in one process: this checkout's generated/ against a folder of
generated modules from another commit (`git archive <commit> generated | tar -x -C /tmp/old`,
then `--old /tmp/old/generated`), forward and forward+backward by triton.testing.do_bench,
min of two interleaved rounds, and whether the outputs and gradients are bit-identical.
`python docs/scripts/kernels_ab.py --old DIR layernorm,rmsnorm,...`"""
import json, os, sys
from pathlib import Path
import torch, triton
from fusegen.bench.cases import load_bench_op, make_inputs, op_kwargs, output_shape

import argparse
parser = argparse.ArgumentParser()
parser.add_argument("ops")
parser.add_argument("--old", required=True)
parser.add_argument("--json", default=None)
options = parser.parse_args()
OPS = options.ops.split(",")
SHAPES = [(torch.bfloat16, (1, 16384, 8192)), (torch.bfloat16, (1, 4096, 4096))]
rows = []
for name in OPS:
    new = load_bench_op(name, Path("specs"), Path("generated"))
    old = load_bench_op(name, Path("specs"), Path(options.old))
    for dtype, bsh in SHAPES:
        torch.manual_seed(0)
        inputs = [t.requires_grad_(True) for t in make_inputs(new.spec, bsh, dtype, "cuda")]
        kw = op_kwargs(new, 0.1)
        gouts = [torch.randn(output_shape(new.spec, bsh), dtype=dtype, device="cuda") for _ in new.spec.outputs]
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
            g = torch.autograd.grad(o, inputs, gouts)
            outs[tag] = [t.detach() for t in o] + list(g)
        same = all(torch.equal(a, b) for a, b in zip(outs["new"], outs["old"]))
        for rep in range(2):
            for tag, b in (("new", new), ("old", old)):
                f = triton.testing.do_bench(fwd(b.op), warmup=25, rep=100)
                fbt = triton.testing.do_bench(fb(b.op), warmup=25, rep=100, grad_to_none=inputs)
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
