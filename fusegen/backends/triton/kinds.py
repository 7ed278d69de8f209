"""The kernel kinds the Triton backend renders, by the name fusegen.kinds registers each
under: a kind's kernel text, launcher class and tuning space are its own module's
(pointwise_kernel_text.py, row_kernel_text.py); a new kind adds its module and one entry here."""
from __future__ import annotations

from . import pointwise_kernel_text, row_kernel_text
from .kernel_text import TritonKind
from .naming import SHARED_NAMES

TRITON_KINDS: dict[str, TritonKind] = {k.name: k for k in (pointwise_kernel_text.KIND, row_kernel_text.KIND)}

# Names the generated code uses for itself: fusegen.planning names nothing spec-derived so.
RESERVED_NAMES = SHARED_NAMES.union(*(k.reserved for k in TRITON_KINDS.values()))
