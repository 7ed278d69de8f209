"""What generated modules share at run time (they import it as `fusegen.runtime`)."""
from .dropout import check_seed, dropout_keep, dropout_mask_reference, dropout_scale, dropout_threshold, seed_tensor
from .launch import (
    BACKWARD_CONFIGS,
    FORWARD_CONFIGS,
    Call,
    FusegenArgumentError,
    GradTarget,
    Problem,
    any_requires_grad,
    autotune_do_bench,
    backward_rows_per_program,
    broadcast_problem,
    check_choice,
    check_out_without_grad,
    check_scalar,
    grid_2d,
    is_interpreting,
    needs_int64,
    output_buffer,
    prune_backward_configs,
    prune_forward_configs,
    sum_to_input,
    view_2d,
    write_out,
    zero_before_trials,
)
from .launcher import CachedLauncher
from .triton_helpers import rsqrt_rn, sqrt_rn

if is_interpreting():
    from .interpreter import patch_bfloat16_rounding, patch_libdevice

    patch_bfloat16_rounding()
    patch_libdevice()

__all__ = [
    "BACKWARD_CONFIGS",
    "FORWARD_CONFIGS",
    "CachedLauncher",
    "Call",
    "FusegenArgumentError",
    "GradTarget",
    "Problem",
    "any_requires_grad",
    "autotune_do_bench",
    "backward_rows_per_program",
    "broadcast_problem",
    "check_choice",
    "check_out_without_grad",
    "check_scalar",
    "check_seed",
    "dropout_keep",
    "dropout_mask_reference",
    "dropout_scale",
    "dropout_threshold",
    "grid_2d",
    "is_interpreting",
    "needs_int64",
    "output_buffer",
    "prune_backward_configs",
    "prune_forward_configs",
    "rsqrt_rn",
    "seed_tensor",
    "sqrt_rn",
    "sum_to_input",
    "view_2d",
    "write_out",
    "zero_before_trials",
]
