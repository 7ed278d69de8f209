"""Generated Python within 100 columns: long statements broken inside brackets, as a person
would break them: a call's or a definition's arguments on the lines after it, as many to a
line as fit, and a long expression at its outermost operators. Only code lines are touched:
comments, docstrings and lines that fit stay as they are, and a line that cannot be broken
is left whole."""
from __future__ import annotations

import ast
import re

LIMIT = 100
# Weakest-binding first: an expression is broken at its outermost operators.
_PRECEDENCE_LEVELS = ((" | ",), (" & ",), (" + ", " - "), (" * ", " / "))
_OPERATORS = tuple(op for level in _PRECEDENCE_LEVELS for op in level)
# `y = ...`, `y += ...`, `a, b = ...`
_ASSIGNMENT = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_.]*, )*[A-Za-z_][A-Za-z0-9_.]*(?:\[[^\]]*\])? (?:\+|-)?= )(.+)$")


def format_module(text: str) -> str:
    """The module with its long lines broken; the same program (its AST is compared)."""
    formatted = _format(text)
    if ast.dump(ast.parse(formatted)) != ast.dump(ast.parse(text)):
        raise ValueError("fusegen.pyformat changed what the generated code means: a fusegen bug")
    return formatted


def _format(text: str) -> str:
    lines, docstring = [], False
    for line in text.split("\n"):
        quotes = line.count('"""')
        if docstring or quotes or len(line) <= LIMIT or line.lstrip().startswith("#") or "  # " in line:
            lines.append(line)
        else:
            indent = line[: len(line) - len(line.lstrip())]
            lines.extend(_statement(line.strip(), indent))
        if quotes % 2:
            docstring = not docstring
    return "\n".join(lines)


def _statement(code: str, indent: str) -> list[str]:
    definition = re.match(r"^(def [A-Za-z_][A-Za-z0-9_]*\()(.*)(\):)$", code)
    if definition:  # def f(a, b, ...): the parameters on the lines after, as many to a line as fit
        opening, parameters, closing = definition.groups()
        parameters = [p.strip() for p in _split(parameters, (", ",))]
        return [indent + opening] + _packed(parameters, indent + "    ") + [indent + closing]
    assignment = _ASSIGNMENT.match(code) or re.match(r"^(return )(.+)$", code)
    if assignment:
        target, value = assignment.groups()
        head = _call_head(value)
        if head is not None:  # y = f(...): break f's arguments
            return _broken_call(indent + target + head, value[len(head):-1], ")", indent)
        return [indent + target + "("] + _expression(value, indent + "    ") + [indent + ")"]
    head = _call_head(code)
    if head is not None:
        return _broken_call(indent + head, code[len(head):-1], ")", indent)
    return [indent + code]


def _expression(expr: str, indent: str, reserve: int = 0) -> list[str]:
    """An expression inside brackets, over as many lines as it needs; `reserve` columns kept
    free at the end (for a comma that follows)."""
    limit = LIMIT - reserve
    if len(indent) + len(expr) <= limit:
        return [indent + expr]
    parts = [expr]
    for level in _PRECEDENCE_LEVELS:
        parts = _split(expr, level)
        if len(parts) > 1:
            break
    if len(parts) > 1:
        lines: list[str] = []
        for part in parts:
            if lines and len(lines[-1]) + 1 + len(part) <= limit:
                lines[-1] += " " + part
            else:
                piece = part.strip()
                if len(indent) + len(piece) > limit:
                    operator, rest = _leading_operator(piece)
                    sub = _expression(rest, indent, reserve)
                    if len(indent) + len(operator) + len(sub[0].lstrip()) > limit:  # the operator pushed it over
                        sub = _expression(rest, indent + " " * len(operator), reserve)
                    sub[0] = indent + operator + sub[0].lstrip()
                    lines.extend(sub)
                else:
                    lines.append(indent + piece)
        return lines
    head = _call_head(expr)
    if head is not None:
        return _broken_call(indent + head, expr[len(head):-1], ")", indent)
    return [indent + expr]


def _broken_call(opening: str, arguments: str, closing: str, indent: str) -> list[str]:
    inner = indent + "    "
    if opening.endswith(" (") or opening.strip() == "(":  # a parenthesized expression, not a call
        return [opening] + _expression(arguments, inner) + [indent + closing]
    single = inner + arguments
    if len(single) <= LIMIT:
        return [opening, single, indent + closing]
    parts = [argument.strip().removeprefix(", ") for argument in _split(arguments, (", ",))]
    if all(len(inner) + len(part) < LIMIT for part in parts):  # whole arguments, as many to a line as fit
        return [opening] + _packed(parts, inner) + [indent + closing]
    lines = [opening]
    for argument in _split(arguments, (", ",)):
        argument = argument.strip().removeprefix(", ")
        lines.extend(_with_comma(_expression(argument, inner, reserve=1)))
    return lines + [indent + closing]


def _packed(parts: list[str], indent: str) -> list[str]:
    """`parts` each followed by a comma, as many to a line as fit."""
    lines = [indent + parts[0] + ","]
    for part in parts[1:]:
        if len(lines[-1]) + 1 + len(part) + 1 <= LIMIT:
            lines[-1] += " " + part + ","
        else:
            lines.append(indent + part + ",")
    return lines


def _with_comma(lines: list[str]) -> list[str]:
    return lines[:-1] + [lines[-1] + ","]


def _leading_operator(piece: str) -> tuple[str, str]:
    for operator in _OPERATORS:
        if piece.startswith(operator.strip() + " "):
            return operator.strip() + " ", piece[len(operator.strip()) + 1:]
    return "", piece


def _call_head(expr: str) -> str | None:
    """`name(` when expr is one call (or one bracketed group) spanning all of it."""
    match = re.match(r"^[A-Za-z_][A-Za-z0-9_.]*\(|^\(", expr)
    if not match or not expr.endswith(")"):
        return None
    head = match.group(0)
    depth, quote = 0, None
    for i in range(len(head) - 1, len(expr)):
        ch = expr[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        else:
            depth += ch in "([{"
            depth -= ch in ")]}"
            if depth == 0 and i != len(expr) - 1:
                return None
    return head


def _split(expr: str, separators: tuple[str, ...]) -> list[str]:
    """expr cut before each separator that is outside brackets and strings."""
    parts, depth, start, i, quote = [], 0, 0, 0, None
    while i < len(expr):
        ch = expr[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and i > start:
            separator = next((s for s in separators if expr.startswith(s, i)), None)
            if separator is not None:
                parts.append(expr[start:i])
                start = i + (2 if separator == ", " else 1)
                i = start
                continue
        i += 1
    parts.append(expr[start:])
    return parts
