"""Backends: each turns a plan (fusegen.plan) into the text of a generated module.

A backend is a package with a `codegen` module defining `RESERVED_NAMES` (the names its
generated code uses for itself, which fusegen.plan gives no spec-derived name),
`check_op_name(name, path, line)` (raises SpecError for an op name its modules cannot define)
and `render(plan) -> str`. Register it here; spec, ir, simplify and plan do not change.
"""
from __future__ import annotations

import importlib

BACKENDS = {"triton": "fusegen.backends.triton.codegen"}
DEFAULT = "triton"


def codegen(name: str = DEFAULT):
    """The backend's codegen module (imported on first use: it brings jinja and sympy)."""
    return importlib.import_module(BACKENDS[name])
