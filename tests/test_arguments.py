"""Runtime argument checks of a generated op: each bad call gets one clear message."""
import re

import pytest
import torch

from fusegen.runtime import FusegenArgumentError
from generated.bias_gelu_dropout_add import bias_gelu_dropout_add

OP = "bias_gelu_dropout_add()"


def _good(device):
    return torch.randn(2, 8, device=device), torch.randn(8, device=device), torch.randn(2, 8, device=device)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, b, r: (x.long(), b, r), f"{OP}: x has dtype torch.int64; supported: float16, bfloat16, float32, float64"),
        (lambda x, b, r: (x.tolist(), b, r), f"{OP}: x must be a torch.Tensor, got list"),
        (lambda x, b, r: (x, torch.randn(7, device=b.device), r), f"{OP}: x [2, 8] and bias [7] disagree on dim N (8 vs 7)"),
        (lambda x, b, r: (x, b, torch.randn(3, 8, device=r.device)), f"{OP}: shapes do not broadcast: x [2, 8] and bias [8] and residual [3, 8]"),
        (lambda x, b, r: (x, b.to("meta"), r), f"{OP}: all tensors must be on one device; got x on {{device}}, bias on meta, residual on {{device}}"),
        (lambda x, b, r: (x, b[None, None], r), f"{OP}: bias must have shape [N], got [1, 1, 8]"),
    ],
    ids=["dtype", "non-tensor", "named-dim", "broadcast", "device", "rank"],
)
def test_bad_tensors(change, message, device):
    good = _good(device)
    x, bias, residual = change(*good)
    expected = message.replace("{device}", str(good[0].device))  # "cuda:0", where the fixture says "cuda"
    with pytest.raises(FusegenArgumentError, match=re.escape(expected)):
        bias_gelu_dropout_add(x, bias, residual)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"p": 1.5}, f"{OP}: p=1.5 is outside [0.0, 1.0]"),
        ({"p": -0.1}, f"{OP}: p=-0.1 is outside [0.0, 1.0]"),
        ({"p": float("nan")}, f"{OP}: p must not be NaN"),
        ({"p": "0.1"}, f"{OP}: p must be a number, got str"),
        ({"activation": "gelux"}, f"{OP}: activation must be one of gelu_tanh, gelu, relu, silu, sigmoid, identity; got 'gelux'"),
    ],
    ids=["p-above", "p-below", "p-nan", "p-str", "choice"],
)
def test_bad_params(kwargs, message, device):
    with pytest.raises(FusegenArgumentError, match=re.escape(message)):
        bias_gelu_dropout_add(*_good(device), **kwargs)
