"""Issue 32: a gemm op's forward with and without a gradient to follow (the kernel's KEEP on and
off: the product, or a hidden layer's values and partials, written for the backward or not),
against the bare matmul(s) of the same shapes; bf16 on the GPU, ms (medians by `fusegen bench`'s
do_bench timer; before the twenty-first session's end, do_bench's default, the mean).
`python docs/scripts/gemm_keep.py` (docs/benchmarks.md, "A forward that no gradient follows")."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import generated.dlrm_mlp as dlrm  # noqa: E402
from fusegen.bench.timing import time_fn  # noqa: E402
import generated.linear_bias_gelu as lbg  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    print(torch.__version__, torch.cuda.get_device_name())
    for n in (4096, 11008):
        x = torch.randn(16384, 4096, device=dev, dtype=bf)
        w = torch.randn(n, 4096, device=dev, dtype=bf) * 0.02
        b = torch.randn(n, device=dev, dtype=bf)
        xg = x.clone().requires_grad_()
        t_mm = time_fn(lambda: x @ w.T).median_ms
        t_no = time_fn(lambda: lbg.linear_bias_gelu(x, w, b)).median_ms
        t_keep = time_fn(lambda: lbg.linear_bias_gelu(xg, w, b)).median_ms
        print(f"linear_bias_gelu 16384x4096x{n}: mm {t_mm:.4f} no-grad {t_no:.4f} ({t_no / t_mm:.3f}x mm) "
              f"grad-follows {t_keep:.4f} ({t_keep / t_mm:.3f}x mm)")
    x = torch.randn(65536, 512, device=dev, dtype=bf)
    w1, b1 = torch.randn(256, 512, device=dev, dtype=bf) * 0.04, torch.randn(256, device=dev, dtype=bf)
    w2, b2 = torch.randn(64, 256, device=dev, dtype=bf) * 0.06, torch.randn(64, device=dev, dtype=bf)
    xg = x.clone().requires_grad_()
    t_no = time_fn(lambda: dlrm.dlrm_mlp(x, w1, b1, w2, b2)).median_ms
    t_keep = time_fn(lambda: dlrm.dlrm_mlp(xg, w1, b1, w2, b2)).median_ms
    t_two = time_fn(lambda: (x @ w1.T) @ w2.T).median_ms
    print(f"dlrm_mlp 65536x512-256-64: no-grad {t_no:.4f} grad-follows {t_keep:.4f} two matmuls {t_two:.4f} "
          f"({t_no / t_two:.3f}x / {t_keep / t_two:.3f}x)")


if __name__ == "__main__":
    main()
