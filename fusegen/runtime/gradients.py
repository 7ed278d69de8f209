"""Where a backward kernel writes each input's gradient, and how that becomes the gradient."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .arguments import Problem


def sum_to_input(grad: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """An output's gradient as the gradient of an input it passes through: itself (no copy)
    where shapes agree, else summed over the broadcast dims."""
    if grad.shape == tensor.shape:
        return grad
    return grad.sum_to_size(tensor.shape)


@dataclass(frozen=True)
class GradTarget:
    """One input's gradient buffer, by how the input was broadcast (worked out once per call
    key; `new_buffer` and `result` run per call):

    - same shape as the output ("full"): written in place, in the input's dtype;
    - broadcast along rows ("rows": bias [N] against [..., N]): per-program column sums in
      fp32, [row_blocks, N], summed across programs here, in a fixed order;
    - broadcast along columns ("columns": scale [..., 1], where the kernel sums those:
      `one_per_row`): per-column-tile row sums in fp32 [column_tiles, M], zeroed first (the
      tuned tile width is not known before launch: as many slots as the narrowest tile
      needs), summed here;
    - any other broadcast ("sum"): a full fp32 gradient, summed to the input's shape here.
    """

    broadcast: str  # how the input was broadcast: "full", "rows", "columns" or "sum" (above)
    buffer_shape: tuple
    buffer_dtype: torch.dtype
    device: torch.device
    shape: torch.Size  # the input's, and its gradient's
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor, problem: Problem, row_blocks: int, column_tiles: int,
           chunks: int = 1, one_per_row: bool = False) -> "GradTarget":
        accumulate = torch.float64 if problem.compute_dtype == torch.float64 else torch.float32
        width = problem.n * chunks
        full_shape = (*problem.shape[:-1], width) if len(problem.shape) else tuple(problem.shape)
        broadcast = cls.broadcast_of(tensor, problem, chunks, one_per_row)
        shape, dtype = {
            "full": (full_shape, tensor.dtype),
            "rows": ((row_blocks, width), accumulate),
            "columns": ((column_tiles, problem.m), accumulate),
            "sum": (full_shape, accumulate),
        }[broadcast]
        return cls(broadcast, shape, dtype, problem.device, tensor.shape, tensor.dtype)

    @staticmethod
    def broadcast_of(tensor: torch.Tensor, problem: Problem, chunks: int = 1, one_per_row: bool = False) -> str:
        """How the input was broadcast against the problem (the cases above): how its gradient is written."""
        width = problem.n * chunks  # a chunked input ([..., 2N]) has all its chunks side by side
        full_shape = (*problem.shape[:-1], width) if len(problem.shape) else problem.shape
        if tensor.shape == full_shape:
            return "full"
        if tensor.numel() == width and tensor.dim() >= 1 and tensor.shape[-1] == width:
            return "rows"
        if one_per_row and tensor.shape == (*problem.shape[:-1], 1):
            return "columns"
        return "sum"

    def new_buffer(self) -> torch.Tensor:
        if self.broadcast == "columns":
            return torch.zeros(self.buffer_shape, dtype=self.buffer_dtype, device=self.device)
        return torch.empty(self.buffer_shape, dtype=self.buffer_dtype, device=self.device)

    def result(self, buffer: torch.Tensor) -> torch.Tensor:
        """The gradient, from the buffer the kernel wrote."""
        if self.broadcast == "full":
            return buffer
        if self.broadcast == "sum":
            return buffer.sum_to_size(self.shape).to(self.dtype)
        return buffer.sum(dim=0).reshape(self.shape).to(self.dtype)
