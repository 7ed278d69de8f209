"""The kernel kinds the Triton backend renders, by the name fusegen.kinds registers each
under: a kind's kernel text, launcher class and tuning space are its own modules'
(pointwise: pointwise_kernel_text.py with launch.py and tuning.py, which every kind shares;
row: row_kernel_text.py, row_launch.py, row_tuning.py; gemm: gemm_kernel_text.py,
gemm_launch.py, gemm_tuning.py with gemm_lib.py); a new kind adds its modules and one
entry here."""
from __future__ import annotations

from . import gemm_kernel_text, pointwise_kernel_text, row_kernel_text
from .kernel_text import TritonKind
from . import naming
from .naming import SHARED_NAMES

TRITON_KINDS: dict[str, TritonKind] = {
    k.name: k for k in (pointwise_kernel_text.KIND, row_kernel_text.KIND, gemm_kernel_text.KIND)
}

# What a generated module imports, every kind's modules included; an op named so would hide one.
MODULE_IMPORTS = naming.MODULE_IMPORTS.union(*(k.modules for k in TRITON_KINDS.values()))
# Names the generated code uses for itself: fusegen.planning names nothing spec-derived so.
RESERVED_NAMES = SHARED_NAMES.union(MODULE_IMPORTS, *(k.reserved for k in TRITON_KINDS.values()))
