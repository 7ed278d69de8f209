"""The Triton module's names: what it imports and uses for itself (which no spec-derived
name may take), its module class's name, and the names it derives from the plan's."""
from __future__ import annotations

from dataclasses import dataclass

from fusegen.names import PYTHON_BUILTINS, Namer
from fusegen.plan import OpPlan

# The kernel_lib helpers a generated module may import (each module imports those it calls).
KERNEL_LIB_NAMES = (
    "add_gradient_partials", "column_tile", "dropout_mask", "dropout_or_ones", "indices", "load_tile", "max_shifts",
    "maximum", "min_shifts", "minimum", "row_max", "row_min", "rsqrt_rn", "sqrt_rn", "store_column_sums", "store_gradient", "store_tile",
)

# What a generated module imports; an op named so would hide one.
MODULE_IMPORTS = frozenset({"torch", "F", "triton", "tl", "libdevice", "runtime", "launch", "tuning", *KERNEL_LIB_NAMES})
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


def module_class_name(op_name: str) -> str:
    """The op's torch.nn.Module class: its name in CamelCase (bias_gelu_dropout_add →
    BiasGeluDropoutAdd), with "Module" added where that is the op's own name or a name the
    module already uses (op Gelu → GeluModule, op f → FModule)."""
    name = "".join(word[:1].upper() + word[1:] for word in op_name.split("_"))
    taken = name == op_name or name in MODULE_IMPORTS or name in PYTHON_BUILTINS
    return f"{name}Module" if taken else name


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
        self.inputs = {
            i.name: InputNames(namer.claim(f"{i.local}_ptr"), namer.claim(f"{i.local}_stride_m"),
                                namer.claim(f"{i.local}_stride_n"))
            for i in plan.inputs
        }
        self.incoming = {
            g: InputNames(namer.claim(f"{g}_ptr"), namer.claim(f"{g}_stride_m"), namer.claim(f"{g}_stride_n"))
            for g in plan.backward.incoming
        }
        self.gradient_pointer = {}
        self.needs, self.sums, self.column_sums, self.accumulator = {}, {}, {}, {}
        for gradient in plan.backward.gradients:
            name, local = gradient.input.name, gradient.input.local
            self.gradient_pointer[name] = namer.claim(f"grad_{local}_ptr")
            self.needs[name] = namer.claim(f"NEEDS_GRAD_{local.upper()}")
            self.sums[name] = namer.claim(f"SUM_GRAD_{local.upper()}")
            if gradient.one_per_row:
                self.column_sums[name] = namer.claim(f"SUM_COLS_GRAD_{local.upper()}")
            for value in gradient.values:
                self.accumulator[value] = namer.claim(f"{value}_sum")
        self.threshold = {p.name: namer.claim(f"dropout_threshold_{p.local}") for p in plan.params if p.dropout_p}
        self.scale = {p.name: namer.claim(f"dropout_scale_{p.local}") for p in plan.params if p.dropout_p}
        self.constexprs = {p.name: namer.claim(p.local.upper()) for p in plan.forward.choices}
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

    def claim_once(self, key: str, wanted: str) -> str:
        """A name a kind's kernels derive for themselves (a row reduction's tile), claimed
        past all the others on first use, the same one after."""
        if key not in self._own:
            self._own[key] = self._namer.claim(wanted)
        return self._own[key]
