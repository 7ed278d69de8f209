"""Row reductions in simplify: the forward as a row program, its backward by reverse mode,
and both scheduled into passes over the row.

A row program computes, per row, its reductions (`sum`, `mean`, `max`, `min` of an element
expression; each a row symbol, constant along the row), row values built from them, and
finally its element results. sympy sees each reduction as a plain symbol, so the
derivatives, CSE and printers of the pointwise path apply unchanged.

The backward is reverse mode over that two-level graph. With g_o the outputs' incoming
gradients, e_k the element expression of reduction r_k and ē_k = a_k·w_k its per-element
adjoint (w = 1 for a sum, 1/N for a mean, and for max/min 1/ties at the elements equal to
r_k, 0 elsewhere, as torch.amax splits it):

    a_k = Σ_row Σ_o g_o ∂f_o/∂r_k  +  Σ_{k' > k} a_k' · w_k' · Σ_row ∂e_k'/∂r_k
    grad_v = Σ_o g_o ∂f_o/∂v  +  Σ_k ē_k ∂e_k/∂v

The adjoints are linear in each other, so every row sum they need depends on the forward's
reductions only: the backward sweeps the row once more for all of them, however deep the
forward nests, then computes the a_k as row values.

Scheduling: a reduction's level is one more than the deepest row symbol it reads; each level
is one pass over the row (a kernel whose rows fit one tile makes every pass over the same
registers). CSE runs over the whole program; each pass lists the element temporaries it
needs, and row-constant temporaries are computed once, after the pass that makes them ready.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .calculus import TEMPORARY_PREFIX, cse, derivative

REDUCTION_PREFIX = "%r"  # the forward's reductions: %r0, %r1, ...
EXTREME_PREFIX = "%e"  # the backward's own max (min) of a max (min) reduction's elements
TIES_PREFIX = "%c"  # the backward's count of maximal (minimal) elements per max (min) reduction
ADJOINT_SUM_PREFIX = "%s"  # the backward's row sums
ADJOINT_PREFIX = "%a"  # the backward's adjoint of each forward reduction
WIDTH = sympy.Symbol("%N", real=True)  # the row's length, in the compute type
# An online sum's rescale factor is an expression of these two: the running extreme's new
# and old values (as shifts: see Reduction.running).
SHIFT_NEW = sympy.Symbol("%new", real=True)
SHIFT_OLD = sympy.Symbol("%old", real=True)


@dataclass(frozen=True)
class Reduction:
    symbol: sympy.Symbol
    op: str  # sum, mean, max or min
    value: sympy.Expr  # the element expression reduced along the row
    # An online sum (softmax's Σ exp(x - max)): it reads the max (min) `running` of the same
    # pass, and is summed at the running value as it grows, each partial sum multiplied by
    # `rescale` (SHIFT_NEW, SHIFT_OLD) when the running value moves: one pass for both.
    running: sympy.Symbol | None = None
    rescale: sympy.Expr | None = None


@dataclass(frozen=True)
class RowPass:
    """One sweep along the row: element temporaries computed per tile, the reductions it
    accumulates, then the row values (constant along the row) those make ready."""

    temps: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    reductions: tuple[Reduction, ...]
    row_values: tuple[tuple[sympy.Symbol, sympy.Expr], ...]


@dataclass(frozen=True)
class RowProgram:
    row_values: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # before any pass: params only
    passes: tuple[RowPass, ...]
    final_temps: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    results: tuple[tuple[str, sympy.Expr], ...]  # element results, each computed per tile
    # The forward keeps each of its reductions per row, in order, as the row's statistics (fp32;
    # fp64 for fp64); the backward loads those it reads, by their place there, instead of reducing again.
    statistics: tuple[sympy.Symbol, ...] = ()
    loaded: tuple[tuple[sympy.Symbol, int], ...] = ()

    @property
    def reductions(self) -> tuple[Reduction, ...]:
        return tuple(r for p in self.passes for r in p.reductions)

    @property
    def definitions(self) -> tuple[tuple[sympy.Symbol, sympy.Expr], ...]:
        """Every name the program defines by an expression (temporaries and row values), each
        once, in order; reductions aside."""
        seen, found = set(), []
        for t, e in (*self.row_values, *(item for p in self.passes for item in (*p.temps, *p.row_values)),
                     *self.final_temps):
            if t not in seen:
                seen.add(t)
                found.append((t, e))
        return tuple(found)

    def renamed(self, rename: dict, results: dict[str, str]) -> "RowProgram":
        """The program over other symbols (`rename`, sympy's xreplace) and result names."""

        def pairs(items):
            return tuple((s.xreplace(rename), e.xreplace(rename)) for s, e in items)

        return RowProgram(
            pairs(self.row_values),
            tuple(
                RowPass(
                    pairs(p.temps),
                    tuple(
                        Reduction(r.symbol.xreplace(rename), r.op, r.value.xreplace(rename),
                                  None if r.running is None else r.running.xreplace(rename), r.rescale)
                        for r in p.reductions
                    ),
                    pairs(p.row_values),
                )
                for p in self.passes
            ),
            pairs(self.final_temps),
            tuple((results[n], e.xreplace(rename)) for n, e in self.results),
            tuple(s.xreplace(rename) for s in self.statistics),
            tuple((s.xreplace(rename), k) for s, k in self.loaded),
        )

    def lines(self) -> list[str]:
        """The program as text, pass by pass: what `fusegen show` prints."""
        out = [f"{s} = (kept by the forward, column {k})" for s, k in self.loaded]
        out += [f"{s} = {e}" for s, e in self.row_values]
        for number, p in enumerate(self.passes, 1):
            out.append(f"# pass {number} along the row")
            out += [f"{s} = {e}" for s, e in p.temps]
            out += [f"{r.symbol} = {r.op}({r.value})" + (f"  # online, with {r.running}" if r.running is not None else "")
                    for r in p.reductions]
            out += [f"{s} = {e}" for s, e in p.row_values]
        out.append("# results, element by element")
        out += [f"{s} = {e}" for s, e in (*self.final_temps, *self.results)]
        return out

    def free_symbols(self) -> set:
        found = set()
        for _, e in (*self.row_values, *self.final_temps, *self.results):
            found |= e.free_symbols
        for p in self.passes:
            for _, e in (*p.temps, *p.row_values):
                found |= e.free_symbols
            for r in p.reductions:
                found |= r.value.free_symbols
        return found


class Reductions:
    """The reductions a lowering meets, each once: `max(x)` written twice is one reduction."""

    def __init__(self, along: set[sympy.Symbol]):
        self.along = along  # the symbols that vary along a row: inputs but [..., 1] ones, masks
        self.found: list[Reduction] = []
        self._by_value: dict[tuple[str, sympy.Expr], sympy.Symbol] = {}

    def add(self, op: str, value: sympy.Expr) -> sympy.Expr:
        if not value.free_symbols & self.along:  # sum(x - x + t): constant along the row, once simplified
            return value * WIDTH if op == "sum" else value
        key = (op, value)
        if key not in self._by_value:
            symbol = sympy.Symbol(f"{REDUCTION_PREFIX}{len(self.found)}", real=True)
            self._by_value[key] = symbol
            self.found.append(Reduction(symbol, op, value))
        return self._by_value[key]


def backward(
    reductions: list[Reduction],
    outputs: list[tuple[str, sympy.Expr]],
    values: dict[str, sympy.Symbol],
    grad_outputs: tuple[sympy.Symbol, ...],
    masks: tuple[sympy.Symbol, ...],
    check,
    row_outputs: frozenset[str] = frozenset(),
    wrt: frozenset[str] | None = None,
    along: set[sympy.Symbol] | None = None,
) -> tuple[list[Reduction], list[tuple[sympy.Symbol, sympy.Expr]], dict[str, sympy.Expr]]:
    """The backward's reductions, its row values (the adjoints) and each value's gradient.
    `check(output, value_name, partial)` refuses a derivative that cannot be a kernel's.

    An output in `row_outputs` has one value per row, and its incoming gradient one per row,
    read along the row as if broadcast: each column carries 1/N of it, so that the row sums
    (and the row sums of [..., 1] inputs' gradients) count it once. `wrt`: the values whose
    gradients are wanted (None: all); every value is an element along the row all the same.
    `along`: the forward's symbols that vary along a row (None: every element may): a row sum
    of anything else (a per-row loss's adjoints, read from one incoming gradient per row) is N
    times it, no pass over the row."""
    incoming = grad_outputs
    grad_outputs = tuple(g / WIDTH if name in row_outputs else g for g, (name, _) in zip(grad_outputs, outputs))
    found: list[Reduction] = []  # the forward's reductions are kept per row (its statistics), not reduced again
    # Per reduction: the adjoint's factor along the row, and which elements receive it. A max
    # (min) counts its ties, on first use: an adjoint that cancels needs none.
    weights: dict[int, tuple[sympy.Expr, sympy.Basic | None]] = {}

    def weight(k: int) -> tuple[sympy.Expr, sympy.Basic | None]:
        if k not in weights:
            r = reductions[k]
            if r.op in ("max", "min"):
                # Which elements are the extreme: compared with the extreme this kernel finds
                # again from the same code, not the one in the forward's statistics (another kernel may
                # round the element expression differently: x / t as x * (1 / t)).
                extreme = sympy.Symbol(f"{EXTREME_PREFIX}{k}", real=True)
                found.append(Reduction(extreme, r.op, r.value))
                ties = sympy.Symbol(f"{TIES_PREFIX}{k}", real=True)
                at_extreme = sympy.Eq(r.value, extreme)
                found.append(Reduction(ties, "sum", sympy.Piecewise((1, at_extreme), (0, True))))
                weights[k] = (1 / ties, at_extreme)
            else:
                weights[k] = (1 / WIDTH if r.op == "mean" else sympy.Integer(1), None)
        return weights[k]

    def selected(k: int, expr: sympy.Expr) -> sympy.Expr:
        factor, at = weight(k)
        return expr if at is None else sympy.Piecewise((expr, at), (0, True))

    sums = 0
    row_values: list[tuple[sympy.Symbol, sympy.Expr]] = []
    adjoints: dict[int, sympy.Symbol] = {}
    # a_k = Σ_row element[k], where the adjoint is one row sum of an element expression.
    element: dict[int, sympy.Expr] = {}
    elements = set(values.values()) | set(masks) | set(grad_outputs)

    # The incoming gradients of outputs with one value per row are constant along it too.
    varying = None if along is None else set(along) | {
        g for g, (name, _) in zip(incoming, outputs) if name not in row_outputs}

    def row_constant(expr: sympy.Expr) -> bool:
        return varying is not None and not expr.free_symbols & varying

    def row_sum(expr: sympy.Expr) -> sympy.Expr:
        if row_constant(expr):
            return WIDTH * expr
        nonlocal sums
        symbol = sympy.Symbol(f"{ADJOINT_SUM_PREFIX}{sums}", real=True)
        sums += 1
        found.append(Reduction(symbol, "sum", expr))
        return symbol

    for k in reversed(range(len(reductions))):
        r = reductions[k].symbol
        summed = sympy.Add(*(g * derivative(f, r) for g, (_, f) in zip(grad_outputs, outputs)))
        terms = []
        for later in range(k + 1, len(reductions)):
            if later not in adjoints:
                continue
            partial = derivative(reductions[later].value, r)
            if partial == 0:
                continue
            factor, at = weight(later)
            closed = None if at is not None else _closed_row_sum(partial, reductions, elements)
            if closed is not None and later in element:
                # a_later · factor · closed = Σ_row (factor · closed · element[later]): one sum, in
                # which terms may cancel (softmax's max: its adjoint is exactly zero).
                summed += factor * closed * element[later]
            elif closed is not None:
                terms.append(adjoints[later] * factor * closed)
            else:
                terms.append(adjoints[later] * factor * row_sum(selected(later, partial)))
        if summed != 0 and row_constant(summed) and sympy.expand(sympy.piecewise_fold(summed)) == 0:
            # Terms under the same where() cancel branch by branch (a cross-entropy's max
            # adjoint, with its ignored rows): none is left, so the max needs no ties.
            summed = sympy.Integer(0)
        if summed != 0:
            terms.insert(0, row_sum(summed))
            if len(terms) == 1:
                element[k] = summed
        made = {r.symbol for r in found} | {a for a in adjoints.values() if isinstance(a, sympy.Symbol)}
        if terms and row_constant(sympy.Add(*terms)) and not sympy.Add(*terms).free_symbols & made:
            # Read from the incoming gradients alone (no row sum): written out where it is
            # used, element by element, where those gradients are read.
            adjoints[k] = sympy.Add(*terms)
        elif terms:
            adjoints[k] = sympy.Symbol(f"{ADJOINT_PREFIX}{k}", real=True)
            row_values.append((adjoints[k], sympy.Add(*terms)))

    per_row = {g for g, (name, _) in zip(incoming, outputs) if name in row_outputs}
    if along is not None and any(e.free_symbols & per_row for _, e in row_values):
        # A row value (an adjoint that needs a row sum too) would read an incoming gradient
        # that the kernels load along the row: sum it along the row instead, as without `along`.
        return backward(reductions, outputs, values, incoming, masks, check, row_outputs, wrt)
    gradients = {}
    for name, symbol in values.items():
        if wrt is not None and name not in wrt:
            continue
        terms = []
        for g, (output, f) in zip(grad_outputs, outputs):
            partial = derivative(f, symbol)
            check(output, name, partial)
            terms.append(g * partial)
        for k, a in adjoints.items():
            partial = derivative(reductions[k].value, symbol)
            if partial != 0:
                terms.append(a * weight(k)[0] * selected(k, partial))
        gradients[name] = sympy.Add(*terms)
    return found, row_values, gradients


def _closed_row_sum(expr: sympy.Expr, reductions: list[Reduction], elements: set) -> sympy.Expr | None:
    """Σ_row expr in closed form, from a forward sum or mean, where there is one: expr = c·e_j
    (Σ = c·r_j, or c·N·r_j for a mean) or expr = α·e_j + β (α·Σe_j + β·N), with c, α and β
    constant along the row. None where expr needs a row sum of its own."""
    for r in reductions:
        if r.op not in ("sum", "mean"):
            continue
        total = r.symbol if r.op == "sum" else WIDTH * r.symbol
        ratio = sympy.cancel(expr / r.value)
        if not (ratio.free_symbols & elements):
            return ratio * total
        # Linear in e_j: write one element symbol t of e_j (e_j linear in t) in terms of u = e_j.
        u = sympy.Dummy("u", real=True)
        for t in sorted(r.value.free_symbols & elements, key=lambda s: s.name):
            coefficient = r.value.diff(t)
            if coefficient == 0 or coefficient.free_symbols & elements or r.value.diff(t, 2) != 0:
                continue
            rewritten = sympy.expand(expr.subs(t, (u - r.value.subs(t, 0)) / coefficient))
            if rewritten.free_symbols & elements or not rewritten.is_polynomial(u) or sympy.degree(rewritten, u) > 1:
                continue
            alpha, beta = rewritten.diff(u), rewritten.subs(u, 0)
            return alpha * total + beta * WIDTH
    return None


def schedule(
    reductions: list[Reduction],
    row_values: list[tuple[sympy.Symbol, sympy.Expr]],
    results: list[tuple[str, sympy.Expr]],
    elements: set[sympy.Symbol],
    forward_statistics: tuple[sympy.Symbol, ...] | None = None,
) -> RowProgram:
    """CSE the whole program and cut it into passes. `elements`: the symbols that differ
    along the row (inputs, masks, incoming gradients), loaded or drawn per tile.
    `forward_statistics`: for a backward, the reductions its forward keeps as statistics (None: a
    forward, which keeps every reduction it makes)."""
    exprs = [r.value for r in reductions] + [e for _, e in row_values] + [e for _, e in results]
    temps, reduced = cse(exprs)
    n_red, n_row = len(reductions), len(row_values)
    reductions = [Reduction(r.symbol, r.op, e) for r, e in zip(reductions, reduced[:n_red])]
    row_values = [(s, e) for (s, _), e in zip(row_values, reduced[n_red:n_red + n_row])]
    results = [(n, e) for (n, _), e in zip(results, reduced[n_red + n_row:])]

    row_symbols = {r.symbol for r in reductions} | {s for s, _ in row_values} | set(forward_statistics or ())
    temps, reductions, results = _row_functions_hoisted(temps, reductions, results, elements, row_symbols)
    definitions = dict(temps)
    reductions = _online(reductions, definitions, row_values)
    online = {r.symbol: r.running for r in reductions if r.running is not None}
    level: dict[sympy.Symbol, int] = {}
    per_element: dict[sympy.Symbol, bool] = {}

    def depth(expr: sympy.Expr) -> int:
        return max((level.get(s, 0) for s in expr.free_symbols), default=0)

    def varies(expr: sympy.Expr) -> bool:
        return any(s in elements or per_element.get(s, False) for s in expr.free_symbols)

    # Temps are numbered in dependency order, reductions and row values listed so too; but a
    # temp may read a reduction listed after it, so levels settle in a loop.
    for r in reductions:
        level[r.symbol] = 0
    for s, _ in row_values:
        level[s] = 0
    changed = True
    while changed:
        changed = False
        for t, e in temps:
            new = depth(e)
            if level.get(t) != new:
                level[t], changed = new, True
            per_element[t] = varies(e)
        for r in reductions:
            new = depth(r.value) + 1
            if r.symbol in online:  # in its max's pass, unless it reads something later anyway
                new = max(depth(r.value.subs(r.running, 0)) + 1, level[r.running])
            if level[r.symbol] != new:
                level[r.symbol], changed = new, True
        for s, e in row_values:
            new = depth(e)
            if level[s] != new:
                level[s], changed = new, True

    def needed(exprs_needing) -> list[tuple[sympy.Symbol, sympy.Expr]]:
        """The element temps these expressions read, through other element temps, in order."""
        wanted, pending = set(), [s for e in exprs_needing for s in e.free_symbols]
        while pending:
            s = pending.pop()
            if s in wanted or s not in definitions or not per_element[s]:
                continue
            wanted.add(s)
            pending.extend(definitions[s].free_symbols)
        return [(t, e) for t, e in temps if t in wanted]

    passes_count = max((level[r.symbol] for r in reductions), default=0)
    row_items = [(t, e) for t, e in temps if not per_element[t]] + list(row_values)
    by_level: dict[int, list] = {}
    for s, e in row_items:
        by_level.setdefault(level[s], []).append((s, e))
    for at in by_level:
        by_level[at] = _dependency_order(by_level[at])
    # An online candidate that did not share its max's pass is an ordinary sum after it.
    reductions = [r if r.running is None or level[r.symbol] == level[r.running]
                  else Reduction(r.symbol, r.op, r.value) for r in reductions]
    passes = []
    for p in range(1, passes_count + 1):
        # Online sums after the pass's other reductions: where the row is one tile, they are
        # taken once at the final max.
        mine = sorted((r for r in reductions if level[r.symbol] == p), key=lambda r: r.running is not None)
        passes.append(RowPass(tuple(needed([r.value for r in mine])), tuple(mine), tuple(by_level.get(p, ()))))
    program = RowProgram(
        row_values=tuple(by_level.get(0, ())),
        passes=tuple(passes),
        final_temps=tuple(needed([e for _, e in results])),
        results=tuple(results),
    )
    if forward_statistics is None:
        return RowProgram(*[getattr(program, f) for f in ("row_values", "passes", "final_temps", "results")],
                          statistics=tuple(r.symbol for r in reductions))
    used = program.free_symbols()
    return RowProgram(*[getattr(program, f) for f in ("row_values", "passes", "final_temps", "results")],
                      loaded=tuple((symbol, k) for k, symbol in enumerate(forward_statistics) if symbol in used))


def _row_functions_hoisted(temps, reductions, results, elements, row_symbols):
    """Each function of row values alone inside an element expression (rsqrt(var + eps),
    log(Σ exp)) made a row temporary: computed once a row, after the pass that makes it ready,
    not once an element; and not live beside the tiles (H100: layernorm's forward at bf16
    (16384, 8192) spilled with rsqrt printed inside its product). Only functions and fractional
    powers: a quotient x / s stays a division, as torch computes it."""
    varying, row = set(elements), set(row_symbols) | {WIDTH}
    for t, e in temps:  # in dependency order
        if e.free_symbols & varying:
            varying.add(t)
        elif e.free_symbols & row:
            row.add(t)
    found: dict[sympy.Expr, None] = {}

    def visit(expr):
        if expr.is_Atom:
            return
        if not (expr.free_symbols & varying):
            if expr.free_symbols & row and (isinstance(expr, sympy.Function) or (expr.is_Pow and not expr.exp.is_integer)):
                found[expr] = None
                return
        for arg in expr.args:
            visit(arg)

    for t, e in temps:
        if t in varying:
            visit(e)
    for e in [r.value for r in reductions] + [e for _, e in results]:
        visit(e)
    if not found:
        return temps, reductions, results
    first = 1 + max((int(t.name[len(TEMPORARY_PREFIX):]) for t, _ in temps), default=-1)
    hoisted = {e: sympy.Symbol(f"{TEMPORARY_PREFIX}{first + k}", real=True) for k, e in enumerate(found)}
    temps = [(t, e if t not in varying else e.xreplace(hoisted)) for t, e in temps]
    temps += [(s, e) for e, s in hoisted.items()]
    reductions = [Reduction(r.symbol, r.op, r.value.xreplace(hoisted)) for r in reductions]
    results = [(n, e.xreplace(hoisted)) for n, e in results]
    return temps, reductions, results


def _online(reductions: list[Reduction], definitions: dict, row_values) -> list[Reduction]:
    """Each sum (mean) whose element expression reads one max (min) m of the program and
    nothing else of the row, in a way that moving m multiplies every element by the same
    factor (exp(x - m): by exp(old - new)), made online: its value written out in full (the
    CSE temporaries read m, which the pass it joins does not have yet) and its rescale."""
    extremes = {r.symbol: r.op for r in reductions if r.op in ("max", "min")}
    symbols = {r.symbol for r in reductions} | {s for s, _ in row_values}
    reading: dict[sympy.Symbol, bool] = {}  # whether a temp reads a reduction or row value, through others

    def reads(t: sympy.Symbol) -> bool:
        if t not in reading:
            free = definitions[t].free_symbols
            reading[t] = bool(free & symbols) or any(reads(u) for u in free & definitions.keys())
        return reading[t]

    found = []
    for r in reductions:
        found.append(r)
        if r.op not in ("sum", "mean"):
            continue
        full = r.value
        for _ in range(len(definitions) + 1):  # temps read temps: substitute until none reads a row symbol
            inline = {t: definitions[t] for t in full.free_symbols & definitions.keys() if reads(t)}
            if not inline:
                break
            full = full.xreplace(inline)
        read = full.free_symbols & symbols
        if len(read) != 1 or not read <= extremes.keys():
            continue
        (m,) = read
        rescale = sympy.simplify(full.subs(m, SHIFT_NEW) / full.subs(m, SHIFT_OLD))
        # exp(k·(old - new)), k > 0 for a max (< 0 for a min): a factor ≤ 1 as the extreme
        # grows (shrinks), finite wherever the two are.
        if not isinstance(rescale, sympy.exp):
            continue
        k = sympy.expand(rescale.args[0]).diff(SHIFT_OLD)
        if not k.is_number or sympy.expand(rescale.args[0] - k * (SHIFT_OLD - SHIFT_NEW)) != 0:
            continue
        if not ((k > 0) if extremes[m] == "max" else (k < 0)):
            continue
        found[-1] = Reduction(r.symbol, r.op, full, m, rescale)
    return found


def _dependency_order(items: list[tuple[sympy.Symbol, sympy.Expr]]) -> list:
    """Row values of one level, each after the ones of that level it reads, else in order."""
    names = {s for s, _ in items}
    done: set = set()
    ordered: list = []
    pending = list(items)
    while pending:
        for i, (s, e) in enumerate(pending):
            if not (e.free_symbols & names) - done:
                ordered.append((s, e))
                done.add(s)
                del pending[i]
                break
        else:  # a cycle cannot happen: CSE and the adjoints only read what is defined before
            raise AssertionError("row values depend on each other in a cycle")
    return ordered
