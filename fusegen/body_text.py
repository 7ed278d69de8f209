"""A plan's straight-line bodies as lines of assignments, for any printer: the kernels'
bodies (a backend's printer) and the reference's (torch's) are printed by the same code."""
from __future__ import annotations

import sympy

from .plan import Body
from .printers import ElementwisePrinter


def statements(body: Body, printer: ElementwisePrinter, constant, tensors: set[str]) -> list[str]:
    """`t0 = ...` lines then `name = ...` lines, each after a comment naming the constants
    it spells as literals; a result that reaches no tensor is broadcast by `constant`."""
    lines = []

    def emit(target: str, text: str) -> None:
        for literal, meaning in printer.constants.items():
            lines.append(f"# {literal} = {meaning}")
        printer.constants.clear()
        lines.append(f"{target} = {text}")

    temps = dict(body.temps)
    for target, expr in body.temps:
        emit(target, printer.doprint(expr))
    for target, expr in body.results:
        text = printer.doprint(expr)
        if constant is not None and not depends_on(expr, temps, tensors):
            text = constant(text)
        emit(target, text)
    return lines


def depends_on(expr: sympy.Expr, temps: dict, tensors: set[str]) -> bool:
    """Whether a result reaches one of `tensors`, directly or through temporaries."""
    pending, seen = [s.name for s in expr.free_symbols], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in temps:
            pending.extend(s.name for s in temps[name].free_symbols)
        elif name in tensors:
            return True
    return False
