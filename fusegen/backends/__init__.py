"""Backends: each turns a plan (fusegen.plan) into the text of a generated module.

A backend is a package with a `codegen` module defining `RESERVED_NAMES` (the names its
generated code uses for itself, which fusegen.plan gives no spec-derived name),
`MODULE_IMPORTS` (the module-level names its modules import, which fusegen.plan refuses as
an op's name: plan.check_op_name raises the SpecError), `render(plan) -> str`, which
reads the plan only and raises nothing about the spec but `Unsupported` (what a backend does not
render yet: the build says it against the spec's file), and `beside(plan) -> dict[str, str]`:
the files the build writes beside the module (file name → text; the CUDA backend's <op>.cu).
Register it here; spec, ir, simplify and plan do not change.
"""
from __future__ import annotations

import importlib

BACKENDS = {"triton": "fusegen.backends.triton.codegen", "cuda": "fusegen.backends.cuda.codegen"}
DEFAULT = "triton"


class Unsupported(ValueError):
    """A plan a backend cannot render (yet): one line naming the op and what."""


def codegen(name: str = DEFAULT):
    """The backend's codegen module (imported on first use: it brings jinja and sympy)."""
    return importlib.import_module(BACKENDS[name])
