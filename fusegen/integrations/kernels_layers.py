"""The layer classes that `fusegen kernels-repo` exposes to Hugging Face's `kernels` package
(see fusegen.integrations.hub_layers): each replaces the forward of the transformers layers
decorated `@use_kernel_forward_from_hub(<its name>)` with a call of one of fusegen's ops.

`kernels` binds a layer's forward to the module it replaces, so `self` below is that module
(a LlamaRMSNorm, say), with its own attributes; the classes hold no state of their own, as
`kernels` requires (no __init__, no members besides `forward`, `has_backward` and
`can_torch_compile`). Each forward computes what the module's own forward computes, up to
rounding, on the tensors it fuses; on any other it calls the module's own forward
(`type(self).forward`: `kernels` replaces the forward of the instance, not of its class).

Imported by the repository's `__init__.py` when `kernels` loads it; it imports torch and the
ops (fusegen.integrations.loading), and nothing of `kernels` or transformers.
"""
import torch

from fusegen.integrations.loading import load_ops

# A checkout's own generated/ (as `generated.<op>`, the module the tests and patch() import),
# else the installed fusegen.ops.
_OPS = load_ops({"gelu", "gelu_tanh", "quick_gelu", "rmsnorm"}, caller="fusegen.integrations.kernels_layers")
gelu, gelu_tanh, quick_gelu, rmsnorm = _OPS["gelu"], _OPS["gelu_tanh"], _OPS["quick_gelu"], _OPS["rmsnorm"]

__all__ = ["RMSNorm", "GeLU", "GeluTanh", "NewGELU", "QuickGELU"]

# transformers' RMSNorm forwards compute in fp32 and cast back: fp64 is computed in fp32 there,
# and fusegen would compute it in fp64, so fp64 takes the module's own forward.
_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class RMSNorm(torch.nn.Module):
    """transformers' RMSNorm layers (LlamaRMSNorm, Qwen3RMSNorm, MistralRMSNorm and the others
    decorated "RMSNorm"): y = weight * x * rsqrt(mean(x², last dim) + variance_epsilon), by
    fusegen's rmsnorm, where x and weight have one dtype (fp16, bf16 or fp32).

    The modules normalize x in fp32; most (Llama's form) then round that to x's dtype and
    multiply by weight in x's dtype (a second rounding), some (OLMo 2's, GPT-OSS's) multiply
    in fp32 and round once. fusegen multiplies in fp32 and rounds once: in fp32 the same up to
    fp32 rounding, in fp16/bf16 OLMo 2's form up to fp32 rounding and Llama's within about one
    unit in the last place of y (the rounding Llama's form does more). Where weight's dtype
    differs from x's (fp32 weights under bf16 activations) the two forms return different
    dtypes and this layer cannot tell which the module has: the module's own forward runs, as
    it does for fp64 (which the modules compute in fp32) and any other dtype.
    """

    weight: torch.Tensor
    variance_epsilon: float

    has_backward = True  # fusegen's fused backward kernel: gradients of x and weight
    can_torch_compile = True  # a torch.library op with a fake implementation; fullgraph

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype not in _NORM_DTYPES or self.weight.dtype != hidden_states.dtype:
            return type(self).forward(self, hidden_states)
        return rmsnorm(hidden_states, self.weight, self.variance_epsilon)


class GeLU(torch.nn.Module):
    """transformers' GELUActivation ("gelu"): the exact (erf) GELU, by fusegen's gelu."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in _ACTIVATION_DTYPES:
            return type(self).forward(self, input)
        return gelu(input)


class GeluTanh(torch.nn.Module):
    """transformers' GELUTanh ("gelu_pytorch_tanh", "gelu_python_tanh"): GELU's tanh
    approximation, by fusegen's gelu_tanh."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in _ACTIVATION_DTYPES:
            return type(self).forward(self, input)
        return gelu_tanh(input)


class NewGELU(torch.nn.Module):
    """transformers' NewGELUActivation ("gelu_new", GPT-2's): 0.5 x (1 + tanh(sqrt(2/π)(x +
    0.044715 x³))), GELU's tanh approximation: fusegen's gelu_tanh, computed in fp32 where the
    module computes each step in x's dtype."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in _ACTIVATION_DTYPES:
            return type(self).forward(self, input)
        return gelu_tanh(input)


class QuickGELU(torch.nn.Module):
    """transformers' QuickGELUActivation ("quick_gelu"): x * sigmoid(1.702 x), by fusegen's
    quick_gelu."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in _ACTIVATION_DTYPES:
            return type(self).forward(self, input)
        return quick_gelu(input)
