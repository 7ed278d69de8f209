"""What generated modules share at run time, whatever their backend (they import it as
`fusegen.runtime`): the op's plumbing (op.FusedOp), argument checks, views, gradient
buffers, out= and dropout's seeds and reference masks."""
from ..layout import Choice, Hidden, Input, LowRank, MatMul, Scalar
from .arguments import FusegenArgumentError, Problem, broadcast_problem, check_choice, check_scalar, range_text
from .dropout import check_seed, dropout_keep, dropout_mask_reference, dropout_scale, dropout_threshold, seed_tensor
from .gradients import GradTarget, sum_to_input
from .op import Call, FusedOp
from .out import check_out_without_grad, output_buffer, write_out
from .reference import decided_where
from .views import needs_int64, view_2d

__all__ = [
    "Call",
    "Choice",
    "FusedOp",
    "FusegenArgumentError",
    "GradTarget",
    "Input",
    "Hidden",
    "LowRank",
    "MatMul",
    "Problem",
    "Scalar",
    "broadcast_problem",
    "check_choice",
    "check_out_without_grad",
    "check_scalar",
    "check_seed",
    "decided_where",
    "dropout_keep",
    "dropout_mask_reference",
    "dropout_scale",
    "dropout_threshold",
    "needs_int64",
    "output_buffer",
    "range_text",
    "seed_tensor",
    "sum_to_input",
    "view_2d",
    "write_out",
]
