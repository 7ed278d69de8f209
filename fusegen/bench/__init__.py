"""`fusegen bench`: time each generated op against eager PyTorch, torch.compile and peers.

The modules, in the order data flows through them:

- arguments: the command line (shapes, dtypes, dropout probabilities, timer),
- cases: the op to benchmark (spec and generated module), shapes, the bytes model, the cases,
- timing: timers (do_bench, device), peak memory, first-call time limits,
- peers: other libraries timed beside them (Liger-Kernel), one registry entry each,
- running: the providers (fusegen, eager, compile, peers) and each case run on each,
- reporting: rows, tables, JSON, CSV and the plot,
- command: `fusegen bench` itself (run_bench).

Everything per case lives in small functions (shape mapping, bytes model, timing, rows,
rendering) so that the CPU-only tests can check the arithmetic without a GPU.

This package re-exports what `fusegen.cli` and `fusegen.profile` use.
"""
from .arguments import (
    DEFAULT_FIRST_CALL_TIMEOUT_S,
    add_bench_arguments,
    add_op_location_arguments,
    parse_dtype,
    parse_p,
    parse_shape,
)
from .cases import Case, load_bench_op, make_inputs, op_kwargs
from .command import interpreter_refusal, no_gpu_exit, run_bench
from .running import forward_fn, make_providers
from .timing import describe_error, is_timeout, time_limit

__all__ = [
    "DEFAULT_FIRST_CALL_TIMEOUT_S",
    "Case",
    "add_bench_arguments",
    "add_op_location_arguments",
    "describe_error",
    "forward_fn",
    "interpreter_refusal",
    "is_timeout",
    "load_bench_op",
    "make_inputs",
    "make_providers",
    "no_gpu_exit",
    "op_kwargs",
    "parse_dtype",
    "parse_p",
    "parse_shape",
    "run_bench",
    "time_limit",
]
