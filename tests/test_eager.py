"""`eager`, the spec as a PyTorch user writes it (F.gelu, F.dropout, ...): an independent
oracle for the reference without dropout, and its own dropout keeps the right fraction."""
import importlib

import pytest
import torch

from fusegen import ir, spec
from tests.helpers import SPEC_DIR, integer_values

SPECS = sorted((spec.load_spec(p) for p in SPEC_DIR.glob("*.yaml")), key=lambda s: s.name)


def _inputs(op_spec, generator):
    sizes = {}
    tensors = []
    for item in op_spec.inputs:
        shape = []
        chunked = len(item.dims) - 1 if item.chunk_dim == -1 else item.chunk_dim  # [..., 2N], or a weight's [2N, K]
        for i, dim in enumerate(item.dims):
            if dim == "...":
                shape += [3, 2]
            elif dim == "1":
                shape.append(1)
            else:
                count = item.chunks if i == chunked else 1
                name = dim
                shape.append(count * sizes.setdefault(name, 24))
        if item.dtype == "float":
            tensors.append(torch.randn(shape, generator=generator, dtype=torch.float64))
        else:  # class indices along the row (a few out of range), or a mask
            tensors.append(integer_values(item.dtype, shape, 24, generator))
    return tensors


@pytest.mark.parametrize("op_spec", SPECS, ids=[s.name for s in SPECS])
def test_eager_matches_reference_without_dropout(op_spec):
    module = importlib.import_module(f"generated.{op_spec.name}")
    has_dropout = bool(ir.build_ir(op_spec).dropouts)
    choices = [{}] + [{c.name: v} for c in op_spec.choice_params for v in c.choices]
    for choice in choices:
        tensors = _inputs(op_spec, torch.Generator().manual_seed(1))
        kwargs = {**choice, **({"training": False} if has_dropout else {})}
        for param in op_spec.scalar_params:
            if param.type == "int":
                continue  # its default (cross_entropy's ignore_index)
            # 0.25 is exact in float32, the precision the kernels (and reference) take params in.
            kwargs.setdefault(param.name, 0.25 if param.max is None or param.max >= 0.25 else param.max)
        got = module.eager(*tensors, **kwargs)
        want = module.reference(*tensors, **kwargs)
        # Compared in float64: an output in float8 or int8 (its own dtype) has no tolerance of its own.
        torch.testing.assert_close(_float64(got), _float64(want), rtol=1e-9, atol=1e-12)


def _float64(results):
    return tuple(t.double() for t in results) if isinstance(results, tuple) else results.double()


def test_eager_dropout_keeps_the_expected_fraction():
    from generated.bias_dropout_add import eager

    torch.manual_seed(0)
    x = torch.randn(256, 256, dtype=torch.float64) + 10  # never 0, so a zero means dropped
    y = eager(x, torch.zeros(256, dtype=torch.float64), torch.zeros(256, 256, dtype=torch.float64), p=0.25)
    kept = (y != 0).double().mean().item()
    assert abs(kept - 0.75) < 5 * (0.75 * 0.25 / y.numel()) ** 0.5


def test_an_output_that_is_an_intermediate_draws_one_mask():
    """bias_dropout_add_layernorm returns h = dropout(x + bias) + residual and layer_norm(h):
    both outputs must come from the same draw (printing h again drew a second mask)."""
    from generated.bias_dropout_add_layernorm import eager

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(8, 64, generator=g, dtype=torch.float64) for _ in range(2))
    bias, weight, norm_bias = (torch.randn(64, generator=g, dtype=torch.float64) for _ in range(3))
    h, y = eager(x, bias, residual, weight, norm_bias, p=0.5)
    assert (h == residual).any()  # some elements dropped
    want = torch.nn.functional.layer_norm(h, (64,), weight, norm_bias, 1e-5)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
