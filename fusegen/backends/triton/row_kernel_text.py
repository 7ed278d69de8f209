"""The text of an op's row kernels (plan kinds ROW and ROW_BACKWARD): a program owns BLOCK_M
whole rows and runs the plan's RowBody over them.

Layouts of the same program, chosen per call by the ONE_TILE and SPLITS constexprs:

- ONE_TILE (the row fits one BLOCK_N tile): the inputs are loaded once, and every pass of the
  program is straight-line code over the same registers;
- ONE_TILE with SPLITS > 1: the same code over one part of the row, each of SPLITS programs
  holding one, each pass's reductions combined across them (kernel_lib.split_program), so the
  row is read once still, forward and backward;
- otherwise each pass is a loop along the row, BLOCK_N columns at a time, that loads what the
  pass reads and accumulates its reductions in [BLOCK_M, BLOCK_N] tiles (reduced along the
  row after the loop), then a last loop computes and stores the results.

Masks of dropout are drawn per tile from each element's flat index, so every pass (and the
backward) draws the same ones; with dropout off they are 1.
"""
from __future__ import annotations

import sympy

from fusegen.body_text import depends_on
from fusegen.plan import SHIFT_NEW, SHIFT_OLD, KernelPlan, OpPlan, RowBody, RowPass, RowReduction

from .kernel_text import (
    COMPUTE_LINE,
    KernelText,
    backward_arguments,
    TritonKind,
    indent as _indent,
    chunk_columns,
    chunk_end,
    gradient_stores,
    gradient_sums,
    input_argument,
    kernel_key,
    input_loads,
    load_line,
    per_row_incoming,
    per_row_load_line,
    width_text,
    scalars_in_compute_type,
    shared_arguments,
    triton_constant,
)
from . import naming
from .naming import TritonNames
from .printer import COMPUTE_DTYPE, TritonPrinter

# The signature's names are naming.py's, which launch.py passes the values by.
# A row too wide for one program may be split across several (kernel_lib.split_program).
_TAIL_ARGUMENTS = [
    f"{naming.BLOCK_N}: tl.constexpr,  # a program's tile: the row or its split's part ({naming.ONE_TILE}), or a step",
    f"{naming.ONE_TILE}: tl.constexpr,  # {naming.BLOCK_N} * {naming.SPLITS} >= {naming.N}",
    f"{naming.SPLITS}: tl.constexpr,  # programs that share a row (a power of two; 1: each owns its rows)",
    f"{naming.SHARES}: tl.constexpr,  # a split row's values a round (its widest pass's reductions)",
    f"{naming.BLOCK_M}: tl.constexpr,",
]
# What else the tuned config is kept for: a config tuned for another tile would not fit.
_LAYOUT = (naming.BLOCK_N, naming.SPLITS)
_EXCHANGE_ARGUMENT = f"{naming.EXCHANGE},  # a split row's tickets, counters and shares (zeroed), else None"
_NEUTRAL = {"sum": "0.0", "mean": "0.0", "max": '-float("inf")', "min": 'float("inf")'}


def row_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    kernel = plan.forward
    arguments = [input_argument(i, names) for i in kernel.inputs]
    arguments += [
        f"{names.output_pointer[name]},  # {name}, contiguous [M, {'1' if name in plan.row_outputs else 'N'}]"
        for name, _ in plan.outputs
    ]
    arguments.append(f"{naming.STATISTICS},  # [M, statistics]: each row's statistics, kept for the backward")
    arguments.append(_EXCHANGE_ARGUMENT)
    arguments.append(f"{naming.M}, {naming.N},  # rows (all leading dims) and columns (the last dim, reduced along)")
    arguments.append(f"{naming.M_BUCKET},  # M rounded up to a power of two: what tuning keys on")
    arguments += shared_arguments(plan, kernel, names, forward=True)
    arguments += _TAIL_ARGUMENTS
    program = _Program(plan, kernel, names, printer)
    if program.online:
        # The autotuner's choice; a tile given by hand (tests) takes the default.
        arguments.append("ONLINE: tl.constexpr = True,  # looped: online sums in their max's pass, not one pass after")
    stores = []
    dtypes = dict(plan.output_dtypes)
    for (name, _), out in zip(plan.outputs, kernel.outputs):
        if name in plan.row_outputs:  # one value a row, stored from the row's first column
            # A declared dtype (float8) converts as torch does (kernel_lib.to_element).
            value = (f"to_element({out}, {out}_ptr.dtype.element_ty)" if name in dtypes
                     else f"{out}.to({out}_ptr.dtype.element_ty)")
            stores.append(
                f"tl.store({out}_ptr + rows[:, None] + cols[None, :] * 0, {value}, "
                "mask=in_bounds & (cols[None, :] == 0))"
            )
        else:
            stores.append(f"store_tile({out}_ptr, {out}, rows, cols, N, in_bounds)")
    lines = [
        COMPUTE_LINE,
        "group, split = split_program(exchange_ptr, SPLITS)",
        "rows = indices(group * BLOCK_M, BLOCK_M, INDEX_64)",
        *program.prologue(),
        "if ONE_TILE:",
        *_indent(program.one_tile(stores + [f"split_leave(exchange_ptr, group, {program.rounds}, SPLITS)"], split=True)),
        "else:",
        *_indent(program.looped(stores, [], [], per_row=set(plan.row_outputs) >= {n for n, _ in plan.outputs})),
    ]
    return KernelText(f"{plan.op}_kernel", kernel_key(plan, backward=False, layout=_LAYOUT), arguments, lines,
                      "row_tuning.ROW_FORWARD_ONLINE" if program.online else "row_tuning.ROW_FORWARD")


def row_backward_kernel(plan: OpPlan, names: TritonNames, printer: TritonPrinter) -> KernelText:
    kernel = plan.backward
    statistics = f"{naming.STATISTICS},  # the forward's statistics, [M, statistics]"
    arguments = backward_arguments(plan, names, "1, M", [statistics, _EXCHANGE_ARGUMENT])
    arguments.append(f"{naming.ROWS_PER_PROGRAM}: tl.constexpr,  # a multiple of BLOCK_M; fixed before launch: it sizes the sums")
    arguments += _TAIL_ARGUMENTS
    program = _Program(plan, kernel, names, printer)
    # One tile (or a split row's part): [N]-like gradients summed in registers over the
    # program's rows, stored after; a split row's rounds go on counting from row block to block.
    passes = program.rounds
    blocks = "row_offset // BLOCK_M" + (f" * {passes}" if passes > 1 else "")  # rounds before this row block
    one_tile = ["cols = indices(split * BLOCK_N, BLOCK_N, INDEX_64)"]
    one_tile += [
        f"{names.accumulator[v]} = tl.zeros((BLOCK_M, BLOCK_N), {COMPUTE_DTYPE})" for g in kernel.gradients for v in g.values
    ]
    stores = [line for g in kernel.gradients for line in gradient_stores(g, names, column_tile="split")]
    one_tile += [
        "for row_offset in range(0, ROWS_PER_PROGRAM, BLOCK_M):",
        "    rows = first_row + row_offset + tl.arange(0, BLOCK_M)",
        "    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)",
        *_indent(program.one_tile(stores, columns_set=True, split=True, first_round=blocks)),
        *[line for g in kernel.gradients for line in gradient_sums(g, names, program="group")],
        f"split_leave(exchange_ptr, group, {blocks.replace('row_offset', 'ROWS_PER_PROGRAM')}, SPLITS)",
    ]
    # Looped: each tile's share of an [N]-like gradient is added to the program's row of sums.
    looped_stores, before, after = [], [], []
    for g in kernel.gradients:
        looped_stores += _looped_gradient_stores(g, names)
        if g.one_per_row:
            name = g.input.name
            accumulator = names.accumulator[g.values[0]]
            before.append(f"{accumulator} = tl.zeros((BLOCK_M, BLOCK_N), {COMPUTE_DTYPE})")
            after += [
                f"if {names.needs[name]} and {names.column_sums[name]}:",
                f"    tl.store({names.gradient_pointer[name]} + rows, tl.sum({accumulator}, axis=1), mask=rows < M)",
            ]
    looped = [
        "for row_offset in range(0, ROWS_PER_PROGRAM, BLOCK_M):",
        "    rows = first_row + row_offset + tl.arange(0, BLOCK_M)",
        "    # The program's row of column sums is read back below: every thread's writes first.",
        "    tl.debug_barrier()",
        *_indent(program.looped(looped_stores, before, after)),
    ]
    lines = [
        COMPUTE_LINE,
        "group, split = split_program(exchange_ptr, SPLITS)",
        "first_row = group * ROWS_PER_PROGRAM",
        "if INDEX_64:",
        "    first_row = first_row.to(tl.int64)",
        *program.prologue(),
        "if ONE_TILE:",
        *_indent(one_tile),
        "else:",
        *_indent(looped),
    ]
    return KernelText(f"{plan.op}_backward_kernel", kernel_key(plan, backward=True, layout=_LAYOUT), arguments, lines,
                      "row_tuning.ROW_BACKWARD")


class _Program:
    """The lines of one RowBody, in either layout."""

    def __init__(self, plan: OpPlan, kernel: KernelPlan, names: TritonNames, printer: TritonPrinter):
        self.plan, self.kernel, self.names, self.printer = plan, kernel, names, printer
        self.body: RowBody = _named_reductions(kernel.body)
        self.tensors = {v.local for i in kernel.inputs for v in i.values} | {m.local for m in kernel.masks}
        self.tensors |= set(kernel.incoming)
        # Row values are [BLOCK_M, 1] tensors too: an expression of them needs no broadcast.
        self.tensors |= {r.symbol.name for r in self.body.reductions} | {s.name for s, _ in self.body.loaded}
        self.temps = {t.name: e for t, e in self.body.definitions}
        self._ops = {r.symbol.name: r.op for r in self.body.reductions}
        self._running = {r.running.name for r in self.body.reductions if r.running is not None}
        self.online = bool(self._running)
        self._per_row_incoming = per_row_incoming(plan)
        self.rounds = sum(1 for p in self.body.passes if p.reductions)  # a split row's exchanges, a row

    # -- pieces ------------------------------------------------------------------

    def prologue(self) -> list[str]:
        lines = scalars_in_compute_type(self.plan, self.kernel, self.names)
        if self.kernel.row_width is not None:
            lines.append(f"{self.kernel.row_width} = tl.full((), N, {COMPUTE_DTYPE})")
        if self.plan.has_dropout:
            lines.append("seed = tl.load(seed_ptr) if HAS_DROPOUT else 0  # without dropout, not read")
        return lines

    def _assignments(self, items, constant=None) -> list[str]:
        lines = []
        for target, expr in items:
            text = self.printer.doprint(expr)
            for literal, meaning in self.printer.constants.items():
                lines.append(f"# {literal} = {meaning}")
            self.printer.constants.clear()
            if constant is not None and not depends_on(expr, self.temps, self.tensors):
                text = constant(text)
            lines.append(f"{target.name if hasattr(target, 'name') else target} = {text}")
        return lines

    def _reads(self, exprs) -> tuple[list, list]:
        """The inputs and masks these expressions read, directly or through temporaries."""
        seen, pending = set(), [s.name for e in exprs for s in e.free_symbols]
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.temps:
                pending.extend(s.name for s in self.temps[name].free_symbols)
        inputs = [i for i in self.kernel.inputs if any(v.local in seen for v in i.values)]
        masks = [m for m in self.kernel.masks if m.local in seen]
        incoming = [g for g in self.kernel.incoming if g in seen]
        return inputs, masks, incoming

    def _loads(self, inputs, masks, incoming, first_col: str) -> list[str]:
        names = self.names
        lines = [line for i in inputs for line in input_loads(i, names.inputs[i.name])]
        lines += [(per_row_load_line if g in self._per_row_incoming else load_line)(g, names.incoming[g])
                  for g in incoming]
        lines += [
            f"{m.local} = dropout_or_ones(seed, rows, {first_col}, N, BLOCK_N, {m.stream}, {names.threshold[m.p.name]}, "
            f"{names.scale[m.p.name]}, HAS_DROPOUT, DROPOUT_WHOLE_GROUPS, shard_ptr, SHARDED)"
            for m in masks
        ]
        return lines

    def _statistics_stores(self, reductions) -> list[str]:
        """The forward keeps each reduction per row for the backward: the row's statistics."""
        places = {s.name: k for k, s in enumerate(self.body.statistics)}
        count = len(self.body.statistics)
        return [
            f"tl.store({_statistics_row(count, places[r.symbol.name])}, tl.reshape({r.symbol.name}, (BLOCK_M,)), mask=rows < M)"
            for r in reductions if r.symbol.name in places
        ]

    def _statistics_loads(self) -> list[str]:
        """The forward's statistics the backward reads, as the forward computed them."""
        count = len(self.plan.forward.body.statistics)
        return [
            f"{symbol.name} = tl.load({_statistics_row(count, k)}, mask=rows < M, other=0.0)[:, None]"
            for symbol, k in self.body.loaded
        ]

    def _tile(self, reduction: RowReduction, running: bool = False) -> str:
        """A looped reduction's [BLOCK_M, BLOCK_N] tile, reduced after the loop; a running
        extreme is its own [BLOCK_M, 1] value, reduced tile by tile (the row's after the loop)."""
        name = reduction.symbol.name
        if running:
            return name
        return self.names.claim_once(name, f"{name}_tile")

    def _value(self, reduction: RowReduction) -> str:
        text = self.printer.doprint(reduction.value)
        if not depends_on(reduction.value, self.temps, self.tensors):
            text = triton_constant(text)
        return f"tl.where(in_bounds, {text}, {_NEUTRAL[reduction.op]})"

    # -- layouts ---------------------------------------------------------------------

    def one_tile(self, stores: list[str], columns_set: bool = False, split: bool = False,
                 first_round: str = "") -> list[str]:
        """The program's rows in one tile; `split`: or its split's part of them (SPLITS > 1),
        each pass's reductions then combined across the group (kernel_lib.split_program), in
        rounds numbered from `first_round` (an expression; 0 if empty)."""
        body = self.body
        first_col = "split * BLOCK_N" if split else "0"
        lines = [] if columns_set else [f"cols, in_bounds = column_tile(rows, {first_col}, M, N, BLOCK_N, INDEX_64)"]
        lines += self._statistics_loads() + self._assignments(body.row_values)
        # The row's own tiles are loaded up front, their loads in flight together; an [N] input
        # (a norm's weight and bias, read from L2) just before the first pass that reads it, so
        # that it is not live through the reductions (H100: a log_softmax backward that loaded
        # x after its reduction was 4% slower; the norms' forwards spilled less).
        every = [r.value for r in body.reductions] + [e for _, e in body.results]
        inputs, masks, incoming = self._reads(every)
        deferred = [i for i in inputs if not _has_rows(i)]
        lines += self._loads([i for i in inputs if _has_rows(i)], masks, incoming, first_col=first_col)

        def loads(exprs) -> list[str]:
            wanted = {i.name for i in self._reads(exprs)[0]}
            now = [i for i in deferred if i.name in wanted]
            deferred[:] = [i for i in deferred if i.name not in wanted]
            return self._loads(now, [], [], first_col=first_col)

        emitted: set = set()
        round_ = 0  # a round for each pass with reductions
        for p in body.passes:
            lines += loads([r.value for r in p.reductions])
            lines += self._assignments([t for t in p.temps if t[0] not in emitted])
            emitted |= {t for t, _ in p.temps}
            for r in p.reductions:
                lines.append(f"{r.symbol.name} = {_reduce(r.op, self._value(r))}")
            if split and p.reductions:
                lines += self._combined(p, f"{first_round} + {round_}" if first_round and round_ else first_round or str(round_))
                round_ += 1
                emitted -= _temps_reading(body.definitions, {r.symbol for r in p.reductions})  # read the part's
            lines += self._statistics_stores(p.reductions)
            lines += self._assignments(p.row_values)
        lines += loads([e for _, e in body.results])
        lines += self._assignments([t for t in body.final_temps if t[0] not in emitted])
        lines += self._assignments(body.results, triton_constant)
        return lines + stores

    def _combined(self, p: RowPass, round_: str) -> list[str]:
        """A split row's pass: each program's reductions over its part shared, then the
        row's combined from them (its online sums rescaled to the row's extreme), in place
        of the part's."""
        shared = {r.symbol.name: self.names.claim_once(f"{r.symbol.name}_shares", f"{r.symbol.name}_shares")
                  for r in p.reductions}
        lines = [f"split_share({r.symbol.name}, exchange_ptr, rows, M, split, {round_}, SHARES, {k}, SPLITS)"
                 for k, r in enumerate(p.reductions)]
        lines.append(f"split_wait(exchange_ptr, group, {round_}, SPLITS)")
        lines += [f'{shared[r.symbol.name]} = split_shares(exchange_ptr, rows, M, {round_}, SHARES, {k}, SPLITS, BLOCK_N, '
                  f'"{"sum" if r.op == "mean" else r.op}")'
                  for k, r in enumerate(p.reductions)]
        online = [r for r in p.reductions if r.running is not None]
        for r in p.reductions:  # the extremes online sums run at come first
            if r.running is None:
                lines.append(f"{r.symbol.name} = {_reduce(r.op, shared[r.symbol.name], mean_of_parts=True)}")
        shifts = {m: tuple(self.names.claim_once(f"{m}_{what}", f"{m}_{what}") for what in ("shift", "shift_before"))
                  for m in dict.fromkeys(r.running.name for r in online)}
        for m, (shift, shift_before) in shifts.items():
            lines.append(f"{shift}, {shift_before} = {self._shifts(m, shared[m], m)}")
        for r in online:
            m = r.running.name
            at = {SHIFT_NEW: sympy.Symbol(shifts[m][0]), SHIFT_OLD: sympy.Symbol(shifts[m][1])}
            rescale = self.printer.doprint(r.rescale.xreplace(at))
            # A part wholly at the far end (every x -inf under a max) adds nothing; its own sum,
            # taken at that extreme, is NaN.
            empty = f"{shared[m]} == {_NEUTRAL[self._ops[m]]}"
            lines.append(f"{r.symbol.name} = row_sum(tl.where({empty}, 0.0, {shared[r.symbol.name]} * {rescale}))")
        return ["if SPLITS > 1:  # the row's parts' reductions, combined", *_indent(lines)]

    def _loop(self, exprs) -> list[str]:
        return [
            "for first_col in range(0, N, BLOCK_N):",
            "    cols, in_bounds = column_tile(rows, first_col, M, N, BLOCK_N, INDEX_64)",
            *_indent(self._loads(*self._reads(exprs), first_col="first_col")),
        ]

    def _shifts(self, extreme: str, before: str, after: str) -> str:
        """A running max (min) before and after, as its online sums' shifts (kernel_lib.max_shifts)."""
        return f"{'max' if self._ops[extreme] == 'max' else 'min'}_shifts({before}, {after})"

    def _online_terms(self, r: RowReduction, new: str, old: str) -> tuple[str, str]:
        """An online sum's rescale factor and value, at the shifts named `new` and `old`."""
        at = {SHIFT_NEW: sympy.Symbol(new), SHIFT_OLD: sympy.Symbol(old)}
        rescale = self.printer.doprint(r.rescale.xreplace(at))
        value = self.printer.doprint(r.value.xreplace({r.running: at[SHIFT_NEW]}))
        return rescale, f"tl.where(in_bounds, {value}, 0.0)"

    def _two_loops(self, p: RowPass) -> list[str]:
        """A pass with online sums as two loops: its other reductions, then the sums at the
        final extreme (fewer operations per element, one more read of the row)."""
        online = [r for r in p.reductions if r.running is not None]
        first = RowPass(p.temps, tuple(r for r in p.reductions if r.running is None), ())
        second = RowPass(_temps_read(p.temps, [r.value for r in online]),
                         tuple(RowReduction(r.symbol, r.op, r.value) for r in online), ())
        return self._pass_loop(first) + self._pass_loop(second)

    def looped(self, stores: list[str], before: list[str], after: list[str], per_row: bool = False) -> list[str]:
        body = self.body
        lines = self._statistics_loads() + self._assignments(body.row_values)
        for p in body.passes:
            if any(r.running is not None for r in p.reductions):
                lines += ["if ONLINE:", *_indent(self._pass_loop(p)), "else:", *_indent(self._two_loops(p))]
            else:
                lines += self._pass_loop(p)
            lines += self._statistics_stores(p.reductions)
            lines += self._assignments(p.row_values)
        lines += before
        exprs = [e for _, e in body.results]
        tail = self._assignments(body.final_temps) + self._assignments(body.results, triton_constant) + stores
        if per_row:  # every result one value a row: the row's first tile stores them, no loop along it
            lines += ["cols, in_bounds = column_tile(rows, 0, M, N, BLOCK_N, INDEX_64)",
                      *self._loads(*self._reads(exprs), first_col="0"), *tail]
        else:
            lines += self._loop(exprs) + _indent(tail)
        return lines + after

    def _pass_loop(self, p: RowPass) -> list[str]:
        """One loop along the row for a pass's reductions (its online sums rescaled as their
        extreme grows), and the reductions after it."""
        lines = []
        plain = [r for r in p.reductions if r.running is None]
        online = [r for r in p.reductions if r.running is not None]
        running = list(dict.fromkeys(r.running.name for r in online))
        names = {m: [self.names.claim_once(f"{m}_{what}", f"{m}_{what}") for what in ("before", "shift", "shift_before")]
                 for m in running}
        tiles = {r.symbol.name: self._tile(r, r.symbol.name in running) for r in p.reductions}
        for r in p.reductions:  # a running extreme is one per row: its sums' lanes share it
            shape = "(BLOCK_M, 1)" if r.symbol.name in running else "(BLOCK_M, BLOCK_N)"
            lines.append(f"{tiles[r.symbol.name]} = tl.full({shape}, {_NEUTRAL[r.op]}, {COMPUTE_DTYPE})")
        lines += self._loop([r.value for r in p.reductions])
        lines += _indent(self._assignments(p.temps))
        for m in running:  # each row's extreme before this tile moves it
            lines.append(f"    {names[m][0]} = {tiles[m]}")
        for r in plain:
            value = self._value(r)
            if r.symbol.name in running:
                value = _reduce(r.op, value)
            lines.append(f"    {_accumulate(r.op, tiles[r.symbol.name], value)}")
        for m in running:
            before_name, shift, shift_before = names[m]
            lines.append(f"    {shift}, {shift_before} = {self._shifts(m, before_name, tiles[m])}")
        for r in online:
            rescale, value = self._online_terms(r, *names[r.running.name][1:])
            tile = tiles[r.symbol.name]
            lines += [f"    {tile} *= {rescale}", f"    {tile} += {value}"]
        for r in plain:
            if r.symbol.name not in running:
                lines.append(f"{r.symbol.name} = {_reduce(r.op, tiles[r.symbol.name])}")
        for r in online:  # every lane's sum is at the row's final extreme already
            lines.append(f"{r.symbol.name} = {_reduce(r.op, tiles[r.symbol.name])}")
        return lines


def _has_rows(i) -> bool:
    """An input with a row dim of its own ([..., N], [M, N]), not broadcast along the rows ([N])."""
    dims = i.layout.dims
    return len(dims) > 1 or dims[:1] == ("...",)


def split_shares_count(plan: OpPlan) -> int:
    """A split row's values a round: the widest pass's reductions, forward or backward (the
    launcher sizes the exchange by it: `shares=` in the module's RowKernels)."""
    kernels = [plan.forward] + ([] if plan.forward_only else [plan.backward])
    return max((len(p.reductions) for k in kernels for p in k.body.passes), default=0)


def _temps_read(temps, exprs) -> tuple:
    """The temporaries these expressions read, directly or through others, in order."""
    wanted, pending = set(), [s for e in exprs for s in e.free_symbols]
    definitions = dict(temps)
    while pending:
        symbol = pending.pop()
        if symbol in definitions and symbol not in wanted:
            wanted.add(symbol)
            pending.extend(definitions[symbol].free_symbols)
    return tuple((t, e) for t, e in temps if t in wanted)


def _named_reductions(body: RowBody) -> RowBody:
    """The body with each reduction that a row value only renames (grad_mean1 = row_sum0, its
    one use) called by that name, and the renaming gone: one name for one value."""
    expressions = [e for _, e in body.definitions] + [r.value for r in body.reductions] + [e for _, e in body.results]
    uses = lambda symbol: sum(symbol in e.free_symbols for e in expressions)  # noqa: E731
    aliases = {
        value: target
        for p in body.passes
        for target, value in p.row_values
        if value in {r.symbol for r in p.reductions} and uses(value) == 1
    }
    if not aliases:
        return body
    body = body.renamed(aliases, {name: name for name, _ in body.results})
    return RowBody(
        body.row_values,
        tuple(RowPass(p.temps, p.reductions, tuple((t, e) for t, e in p.row_values if t != e)) for p in body.passes),
        body.final_temps, body.results, body.statistics, body.loaded,
    )


def _reduce(op: str, tile: str, mean_of_parts: bool = False) -> str:
    """A [BLOCK_M, BLOCK_N] tile reduced along the row to [BLOCK_M, 1]; `mean_of_parts`: a
    split row's parts' means (each over the row's N already) summed."""
    if op == "max":
        return f"row_max({tile})"
    if op == "min":
        return f"row_min({tile})"
    total = f"row_sum({tile})"
    return f"{total} / N" if op == "mean" and not mean_of_parts else total


def _temps_reading(definitions, symbols: set) -> set:
    """The temporaries that read these symbols, directly or through others."""
    reading = set(symbols)
    for target, expr in definitions:
        if expr.free_symbols & reading:
            reading.add(target)
    return reading - set(symbols)


def _accumulate(op: str, tile: str, value: str) -> str:
    if op == "max":
        return f"{tile} = maximum({tile}, {value})"
    if op == "min":
        return f"{tile} = minimum({tile}, {value})"
    return f"{tile} += {value}"


def _statistics_row(count: int, k: int) -> str:
    """Statistic k of each row in the [M, count] statistics buffer."""
    rows = "rows" if count == 1 else f"rows * {count}"
    return f"{naming.STATISTICS} + {rows}" + (f" + {k}" if k else "")


def _looped_gradient_stores(gradient, names: TritonNames) -> list[str]:
    """A looped tile's gradient: written in full, added to the program's row of column sums
    (the first row block writes it), or added to the row sums' tile."""
    name = gradient.input.name
    pointer, width = names.gradient_pointer[name], width_text(gradient.input)
    if not gradient.one_per_row:
        return [
            f"add_gradient_partials({pointer}, {v}, rows, {chunk_columns(k)}, {chunk_end(k)}, {width}, in_bounds, "
            f"row_offset == 0, "
            f"{names.needs[name]}, {names.sums[name]})"
            for k, v in enumerate(gradient.values)
        ]
    value, accumulator = gradient.values[0], names.accumulator[gradient.values[0]]
    return [
        f"if {names.needs[name]} and {names.column_sums[name]} and not {names.sums[name]}:",
        f"    {accumulator} += tl.where(in_bounds, {value}, 0.0)",
        "else:",
        f"    add_gradient_partials({pointer}, {value}, rows, cols, N, {width}, in_bounds, row_offset == 0, "
        f"{names.needs[name]}, {names.sums[name]})",
    ]


KIND = TritonKind(
    name="row",
    forward=row_kernel,
    backward=row_backward_kernel,
    binding="row_launch.RowKernels",
    keywords=lambda plan: (f"shares={split_shares_count(plan)}",),
    modules=("row_launch", "row_tuning", "tuning"),
    doc="The Triton kernels own whole rows: a row up to 16384 wide (8192 in the backward; a 16-bit row to 32768 "
        "where few tiles are loaded) is loaded once and reduced in registers; a wider row runs the fastest "
        "layout timed on its shape's first launch: split across programs that each hold a part and combine "
        "their reductions, or swept once per level of nested reductions.",
    reserved=frozenset({"first_col", naming.ONE_TILE, naming.STATISTICS, "ONLINE", naming.EXCHANGE, naming.SPLITS,
                        naming.SHARES, "group", "split"}),
)
