"""The built-in `col` (issue 31): the element's index along the last dim, 0 <= col < N. A one-hot
is `where(col == t, 1.0, 0.0)`, the target's logit `sum(where(col == t, x, 0.0))`, whose
gradient (the scatter back) simplify derives. Targets here are float [..., 1] inputs holding
whole numbers (integer inputs: test_language_int_inputs.py). Bad uses: test_bad_specs.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import build_and_import

# Per-row cross-entropy, shifted by the row's max as log_softmax is.
CROSS_ENTROPY = """\
name: ce_rows
doc: per-row cross-entropy of logits x at the class index t
inputs:
  x: [..., N]
  t: [..., 1]
let:
  shifted: x - max(x)
outputs:
  loss: log(sum(exp(shifted))) - sum(where(col == t, shifted, 0.0))
"""

ONE_HOT = """\
name: one_hot_mix
doc: x at the target's column, plus x in the first three columns of each chunk
inputs:
  x: [..., 2N]
  t: [..., 1]
outputs:
  y: chunk(x, 0) * where(col == t, 1.0, 0.0) + where(col < 3, chunk(x, 1), 0.0)
"""


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("col")
    return {"ce": build_and_import(folder, CROSS_ENTROPY), "one_hot": build_and_import(folder, ONE_HOT)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_cross_entropy_with_col_is_torchs(ops, dtype, device):
    module = ops["ce"]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 24, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.tensor([0, 5, 23, 11])
    t = target.to(dtype)[:, None]
    xs = x.to(device).requires_grad_(True)
    loss = module.ce_rows(xs, t.to(device))
    assert loss.shape == (4, 1)
    x64 = x.double().requires_grad_(True)
    want = F.cross_entropy(x64, target, reduction="none")
    grad_out = torch.randn(4, generator=g, dtype=torch.float64)
    (got_grad,) = torch.autograd.grad(loss[:, 0], xs, grad_out.to(dtype).to(device))
    (want_grad,) = torch.autograd.grad(want, x64, grad_out)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss[:, 0].detach().cpu().double(), want.detach(), **tol)
    torch.testing.assert_close(got_grad.cpu().double(), want_grad, **tol)  # softmax - one_hot(target)
    for fn in (module.reference, module.eager):
        torch.testing.assert_close(fn(x64, t.double())[:, 0], want, rtol=1e-12, atol=1e-14)


def test_one_hot_and_column_ranges_per_chunk(ops, device):
    module = ops["one_hot"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)
    t = torch.tensor([[1.0], [7.0], [4.0]], dtype=torch.float64)
    xs = x.to(device).requires_grad_(True)
    y = module.one_hot_mix(xs, t.to(device))
    a, b = x.chunk(2, dim=-1)
    cols = torch.arange(8)
    want = a * (cols == t) + torch.where(cols < 3, b, 0.0)
    torch.testing.assert_close(y.detach().cpu(), want, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(y.sum(), xs)
    want_grad = torch.cat([(cols == t).double().expand(3, 8), (cols < 3).double().expand(3, 8)], dim=-1)
    torch.testing.assert_close(grad.cpu(), want_grad, rtol=0, atol=0)  # the scatter back
    for fn in (module.reference, module.eager):
        torch.testing.assert_close(fn(x, t), want, rtol=0, atol=0)
