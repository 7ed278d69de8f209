"""The Triton module's names: what it imports and uses for itself (which no spec-derived
name may take), its module class's name, and the names it derives from the plan's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusegen.names import PYTHON_BUILTINS, Namer

if TYPE_CHECKING:  # the plan (and sympy) only where a module is generated, not where one runs
    from fusegen.plan import OpPlan

# The kernel_lib helpers a generated module may import (each module imports those it calls).
KERNEL_LIB_NAMES = (
    "add_gradient_partials", "column_tile", "dropout_mask", "dropout_or_ones", "indices", "load_per_row",
    "load_tile", "max_shifts", "maximum", "min_shifts", "minimum", "row_max", "row_min", "row_sum", "rsqrt_rn",
    "split_leave", "split_program", "split_share", "split_shares", "split_wait", "sqrt_rn", "store_column_sums",
    "store_gradient", "store_tile", "to_element",
)

# The gemm_lib helpers a gemm kernel calls, imported by name as kernel_lib's are (Inductor
# re-emits a kernel with the JIT functions it calls by name, not through a module attribute).
GEMM_LIB_NAMES = ("chunk_start", "column_part", "inner_matmul", "matmul_lowrank_tile", "matmul_lowrank_tile_tma",
                  "matmul_tile", "matmul_tile_tma", "tile_of", "tma_b", "tma_operands")

# What every generated module imports (each kind adds its own modules: kinds.py).
MODULE_IMPORTS = frozenset({"torch", "F", "triton", "tl", "libdevice", "runtime", "launch", "tuning", *KERNEL_LIB_NAMES,
                            *GEMM_LIB_NAMES})
# Names every Triton module's code uses for itself (each kind adds its kernels' own: kinds.py).
SHARED_NAMES = (
    MODULE_IMPORTS
    | {"reference", "eager", "_OP", "_reference"}
    # the kernels' own arguments and locals
    | {"compute", "rows", "cols", "in_bounds", "M", "N", "M_BUCKET", "seed", "seed_ptr", "shard_ptr", "first_row",
       "row_offset"}
    | {"HAS_DROPOUT", "DROPOUT_WHOLE_GROUPS", "SHARDED", "INDEX_64", "COMPUTE_FP64", "BLOCK_M", "BLOCK_N", "ROWS_PER_PROGRAM"}
    # the reference body's and the module class's
    | {"problem", "masks", "self", "training"}
    | PYTHON_BUILTINS
)


# The kernels' parameters that every op's kernels name alike: the kernel text writes its
# signatures with these, and launch.py passes each its value by these names.
M, N, M_BUCKET = "M", "N", "M_BUCKET"
SEED, SHARD = "seed_ptr", "shard_ptr"
HAS_DROPOUT, DROPOUT_WHOLE_GROUPS, SHARDED = "HAS_DROPOUT", "DROPOUT_WHOLE_GROUPS", "SHARDED"
INDEX_64, COMPUTE_FP64 = "INDEX_64", "COMPUTE_FP64"
ROWS_PER_PROGRAM, BLOCK_M, BLOCK_N = "ROWS_PER_PROGRAM", "BLOCK_M", "BLOCK_N"
STATISTICS, ONE_TILE = "statistics_ptr", "ONE_TILE"  # the row kernels' (row_kernel_text.py)
# The gemm kernels' (gemm_kernel_text.py): the reduced dim, the tile along it, the tiles' grouping.
K, BLOCK_K, GROUP_M, INPUT_PRECISION, FP64_PRODUCT = "K", "BLOCK_K", "GROUP_M", "INPUT_PRECISION", "FP64_PRODUCT"
TMA, A_K_MAJOR, B_K_MAJOR, PARTS = "TMA", "A_K_MAJOR", "B_K_MAJOR", "PARTS"
RANK, BLOCK_R = "R", "BLOCK_R"  # a low-rank product's inner dim, and its tile (gemm_lib.inner_matmul)
HIDDEN, BLOCK_H = "H", "BLOCK_H"  # a hidden layer's width, and its tile
KEEP = "KEEP"  # whether a gemm forward writes what its backward reads (off where no gradient follows)
EXCHANGE, SPLITS, SHARES = "exchange_ptr", "SPLITS", "SHARES"  # a split row's (kernel_lib.split_program)


# The parameters named for a spec's input, output or param: what each is wanted as, from
# the name it derives from (TritonNames claims them from the plan's locals; launch.py asks
# for them by spec name, through ParameterNames).
def pointer(base: str) -> str:
    return f"{base}_ptr"


WANTED = {
    "pointer": pointer,  # an input's, and its strides
    "stride_m": lambda base: f"{base}_stride_m",
    "stride_n": lambda base: f"{base}_stride_n",
    "stride_k": lambda base: f"{base}_stride_k",  # a matmul operand's along K
    "output": pointer,  # an output's pointer
    "incoming": lambda output: pointer(f"grad_{output}"),  # an output's incoming gradient, and its strides
    "incoming_stride_m": lambda output: f"grad_{output}_stride_m",
    "incoming_stride_n": lambda output: f"grad_{output}_stride_n",
    "gradient": lambda base: pointer(f"grad_{base}"),  # an input's gradient buffer, and its flags
    "needs": lambda base: f"NEEDS_GRAD_{base.upper()}",
    "sums": lambda base: f"SUM_GRAD_{base.upper()}",
    "column_sums": lambda base: f"SUM_COLS_GRAD_{base.upper()}",
    "scalar": lambda base: base,
    "threshold": lambda base: f"dropout_threshold_{base}",  # a dropout p's
    "scale": lambda base: f"dropout_scale_{base}",
    "choice": lambda base: base.upper(),  # a choice's constexpr
}


class ParameterNames:
    """A kernel parameter's name by what it is and the spec name it is for (("pointer",
    "x") → "x_ptr"): as WANTED makes it, except those the generated module lists as
    `renamed` (the namer gave another, past a clash)."""

    def __init__(self, renamed: dict[tuple[str, str], str] | None = None):
        self._renamed = renamed or {}

    def __call__(self, what: str, name: str) -> str:
        return self._renamed.get((what, name)) or WANTED[what](name)


def module_class_name(op_name: str) -> str:
    """The op's torch.nn.Module class in a Triton module (fusegen.face.module_class_name)."""
    from fusegen.face import module_class_name as class_name  # the face brings jinja: on use only

    return class_name(op_name, MODULE_IMPORTS)


@dataclass(frozen=True)
class InputNames:
    pointer: str
    stride_m: str
    stride_n: str


class TritonNames:
    """The Triton module's own names for what the plan named: pointers, strides, gradient
    buffers and sums, constexprs, dropout arguments and helper functions; claimed past the
    plan's taken names, so none is a spec name or another's."""

    def __init__(self, plan: OpPlan):
        namer = Namer(plan.taken)
        # A matmul's operands are read by the matmuls only, their products as inputs are (gemm kind).
        matmul = plan.matmul
        operands, products = (), ()
        if matmul:
            lowrank, hidden = matmul.lowrank, matmul.hidden
            operands = (matmul.a, matmul.b, *((lowrank.down, lowrank.up) if lowrank else ()),
                        *((hidden.weight,) if hidden else ()))
            products = (matmul.product, *((lowrank.value,) if lowrank else ()))
        self.inputs = {
            i.name: InputNames(namer.claim(pointer(i.local)), namer.claim(WANTED["stride_m"](i.local)),
                                namer.claim(WANTED["stride_n"](i.local)))
            for i in (*plan.inputs, *products) if i not in operands
        }
        # An operand's pointer and its two strides: a [M, K] (stride_m, stride_k), b [K, N]
        # (stride_k, stride_n; nn.Linear's [N, K] weight as its transpose); a low-rank product's
        # down [K, R] and up [R, N] as b is.
        self.operands = {
            i.name: (namer.claim(pointer(i.local)), *(namer.claim(WANTED[s](i.local)) for s in _operand_strides(k)))
            for k, i in enumerate(operands)
        }
        self.incoming = {
            g: InputNames(namer.claim(pointer(g)), namer.claim(WANTED["stride_m"](g)), namer.claim(WANTED["stride_n"](g)))
            for g in plan.backward.incoming
        }
        self.gradient_pointer = {}
        self.needs, self.sums, self.column_sums, self.accumulator = {}, {}, {}, {}
        for gradient in plan.backward.gradients:
            name, local = gradient.input.name, gradient.input.local
            self.gradient_pointer[name] = namer.claim(WANTED["gradient"](local))
            self.needs[name] = namer.claim(WANTED["needs"](local))
            self.sums[name] = namer.claim(WANTED["sums"](local))
            if gradient.one_per_row:
                self.column_sums[name] = namer.claim(WANTED["column_sums"](local))
            for value in gradient.values:
                self.accumulator[value] = namer.claim(f"{value}_sum")
        self.threshold = {p.name: namer.claim(WANTED["threshold"](p.local)) for p in plan.params if p.dropout_p}
        self.scale = {p.name: namer.claim(WANTED["scale"](p.local)) for p in plan.params if p.dropout_p}
        self.constexprs = {p.name: namer.claim(WANTED["choice"](p.local)) for p in plan.forward.choices}
        # As the kinds' kernel text has always written them (unclaimed: each output's local is).
        self.output_pointer = {name: pointer(local) for (name, _), local in zip(plan.outputs, plan.forward.outputs)}
        # Module-level helpers start with '_', as spec names never do: they only need to
        # differ from each other.
        self.triton_helpers = {}
        for helper in plan.helpers:
            param, arity = helper.param, len(helper.args)
            self.triton_helpers[(param.name, None)] = namer.claim(f"_{param.local}")
            for k in range(arity):
                suffix = "_grad" if arity == 1 else f"_grad{k}"
                self.triton_helpers[(param.name, k)] = namer.claim(f"_{param.local}{suffix}")
        self._namer, self._own = namer, {}
        self._plan = plan

    def parameters(self) -> dict[tuple[str, str], str]:
        """Every spec-named kernel parameter, keyed as ParameterNames asks for it."""
        plan, named = self._plan, {}
        for name, n in self.inputs.items():
            named.update({("pointer", name): n.pointer, ("stride_m", name): n.stride_m, ("stride_n", name): n.stride_n})
        for k, (name, (ptr, *strides)) in enumerate(self.operands.items()):
            named.update({("pointer", name): ptr,
                          **{(kind, name): stride for kind, stride in zip(_operand_strides(k), strides)}})
        for (output, _), incoming in zip(plan.outputs, plan.backward.incoming):
            n = self.incoming[incoming]
            named.update({("incoming", output): n.pointer, ("incoming_stride_m", output): n.stride_m,
                          ("incoming_stride_n", output): n.stride_n})
        named.update({("output", name): pointer for name, pointer in self.output_pointer.items()})
        for what, table in (("gradient", self.gradient_pointer), ("needs", self.needs), ("sums", self.sums),
                            ("column_sums", self.column_sums), ("threshold", self.threshold),
                            ("scale", self.scale), ("choice", self.constexprs)):
            named.update({(what, name): parameter for name, parameter in table.items()})
        named.update({("scalar", p.name): p.local for k in (plan.forward, plan.backward) for p in k.scalars})
        return named

    def renamed(self) -> dict[tuple[str, str], str]:
        """The parameters not named as WANTED makes them from the spec's names (a clash):
        what the generated module lists for launch.py's ParameterNames."""
        return {key: name for key, name in self.parameters().items() if name != WANTED[key[0]](key[1])}

    def claim_once(self, key: str, wanted: str) -> str:
        """A name a kind's kernels derive for themselves (a row reduction's tile), claimed
        past all the others on first use, the same one after."""
        if key not in self._own:
            self._own[key] = self._namer.claim(wanted)
        return self._own[key]


def _operand_strides(k: int) -> tuple[str, str]:
    """The strides of a matmul's k-th operand (a, b, then a low-rank product's down and up, or a
    hidden layer's weight)."""
    return ("stride_m", "stride_k") if k == 0 else ("stride_k", "stride_n")
