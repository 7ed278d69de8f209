"""Where a backward kernel writes each input's gradient, and how that becomes the gradient."""
from __future__ import annotations

import torch

from .arguments import Problem


def sum_to_input(grad: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """An output's gradient as the gradient of an input it passes through: itself (no copy)
    where shapes agree, else summed over the broadcast dims."""
    if grad.shape == tensor.shape:
        return grad
    return grad.sum_to_size(tensor.shape)


class GradTarget:
    """One input's gradient buffer, by how the input was broadcast:

    - same shape as the output ("full"): written in place, in the input's dtype;
    - broadcast along rows ("rows": bias [N] against [..., N]): per-program column sums in
      fp32, [row_blocks, N], summed across programs here, in a fixed order;
    - broadcast along columns ("columns": scale [..., 1], where the kernel sums those:
      `one_per_row`): per-column-tile row sums in fp32 [column_tiles, M], zeroed first (the
      tuned tile width is not known before launch: as many slots as the narrowest tile
      needs), summed here;
    - any other broadcast ("sum"): a full fp32 gradient, summed to the input's shape here.
    """

    def __init__(self, tensor: torch.Tensor, problem: Problem, row_blocks: int, column_tiles: int,
                 chunks: int = 1, one_per_row: bool = False):
        self.shape, self.dtype = tensor.shape, tensor.dtype
        accumulate = torch.float64 if problem.compute_dtype == torch.float64 else torch.float32
        device = problem.device
        width = problem.n * chunks
        full_shape = (*problem.shape[:-1], width) if len(problem.shape) else problem.shape
        self.kind = self.kind_of(tensor, problem, chunks, one_per_row)
        if self.kind == "full":
            self.buffer = torch.empty(full_shape, dtype=tensor.dtype, device=device)
        elif self.kind == "rows":
            self.buffer = torch.empty((row_blocks, width), dtype=accumulate, device=device)
        elif self.kind == "columns":
            self.buffer = torch.zeros((column_tiles, problem.m), dtype=accumulate, device=device)
        else:
            self.buffer = torch.empty(full_shape, dtype=accumulate, device=device)

    @staticmethod
    def kind_of(tensor: torch.Tensor, problem: Problem, chunks: int = 1, one_per_row: bool = False) -> str:
        """How the input's gradient is written (the kinds above), from how it was broadcast."""
        width = problem.n * chunks  # a chunked input ([..., 2N]) has all its chunks side by side
        full_shape = (*problem.shape[:-1], width) if len(problem.shape) else problem.shape
        if tensor.shape == full_shape:
            return "full"
        if tensor.numel() == width and tensor.dim() >= 1 and tensor.shape[-1] == width:
            return "rows"
        if one_per_row and tensor.shape == (*problem.shape[:-1], 1):
            return "columns"
        return "sum"

    def result(self) -> torch.Tensor:
        if self.kind == "full":
            return self.buffer
        if self.kind in ("rows", "columns"):
            return self.buffer.sum(dim=0).reshape(self.shape).to(self.dtype)
        return self.buffer.sum_to_size(self.shape).to(self.dtype)
