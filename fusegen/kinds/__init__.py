"""Kernel kinds, registered: what an op's kernels compute and how a program covers the
problem. Each kind is its own module (fusegen.kinds.base says what one brings); a new kind
adds its module and one entry here, and its kernel text and launcher beside each backend
(fusegen/backends/<name>/kinds.py). Plan building asks `kind_of(op)`; a backend and the
module's Python face look a plan's kind up by name (`KINDS[plan.kind]`)."""
from __future__ import annotations

from . import gemm, pointwise, row
from .base import Kind, ReferenceBody

__all__ = ["KINDS", "Kind", "ReferenceBody", "kind_of"]

KINDS: dict[str, Kind] = {k.name: k for k in (pointwise.KIND, row.KIND, gemm.KIND)}


def kind_of(op) -> Kind:
    """The kind of simplify's op (fusegen.simplify.SimplifiedOp)."""
    (kind,) = [k for k in KINDS.values() if k.matches(op)]
    return kind
