"""The row kind's kernels in CUDA C++ (issue 33): the plan's RowBody, a block a run of rows.

A block of Threads takes a run of adjacent rows (one where the grid has a block a row); each pass
of the body is a loop along the row, a thread taking packs of Pack adjacent columns Threads · Pack
apart (vector loads where the launcher's views allow, as the pointwise kind's: pointwise_source), its
reductions accumulated in each thread and then across the block (fusegen::block_reduce). A
pass's online sums (softmax's Σ exp(x - max)) take a loop of their own after their extreme is
known. With Items > 0 the row is held: at each row's start every thread loads its Items packs of
each value with rows (inputs, incoming gradients, dropout's masks), all loads in flight at once,
and every pass reads them back (each thread only its own columns: no barrier), the loops unrolled
by item; the forward holds the [N] inputs its passes read too, and the rows only its results read
(_Rows.held); other [N] inputs are read where used (cached). Held in registers (Registers: fewer instructions,
more registers a thread) or in shared memory (fewer registers, more rows an SM at once): the
launcher picks by dtype (row_launch.LAYOUTS). With Items 0 each pass reads the row again. The
forward keeps each row's reductions ([M, statistics], in T) for the backward, which reads
them back and computes each gradient element by element: written, or summed over the block's
rows where its input is one row broadcast to all (in each thread's registers where the row is
held: a thread's columns are the same every row; else in the block's row of a [blocks, N]
buffer; torch adds the blocks' rows up in order: deterministic).

Outputs of one value a row ([..., 1]: a loss, a scale) are computed once a row and stored by its
first thread; integer inputs of one value a row (a class index) and the incoming gradients of such
outputs are loaded once a row; float8 outputs convert as torch does (fusegen_cuda.cuh); an op
without gradients has the forward alone. Rows wider than one block holds go to a cluster of
blocks (Cluster > 1, sm_90), each holding its columns [begin, end). In a kernel whose results are
all 16-bit or narrower (Narrow), exp is the GPU's ex2.approx (fusegen::exp). Dropout's masks are
drawn at the global problem's flat index where the call is a DTensor's local part (the shard's
sizes: fusegen::flat_index). Not yet (each a one-line
CudaUnsupported): outputs in parts, choice params; online sums in one loop where the row is read
again."""
from __future__ import annotations

from fusegen import outdir
from fusegen.names import Namer
from fusegen.plan import KernelPlan, OpPlan

from .pointwise_source import (CPP_KEYWORDS, OWN_NAMES, CudaUnsupported, _check, _column, _dropout_parameters, _indent,
                               _width, integer_names, scalar_type)
from .printer import CudaPrinter

_NEUTRAL = {"sum": "T(0)", "mean": "T(0)", "max": "-fusegen::infinity<T>()", "min": "fusegen::infinity<T>()"}
_REDUCE = {"sum": "fusegen::row_sum", "mean": "fusegen::row_sum", "max": "fusegen::row_max", "min": "fusegen::row_min"}


def _refuse(plan: OpPlan) -> None:
    what = ("an output in parts" if plan.output_parts else
            "a choice param" if plan.helpers else None)
    if what is not None:
        raise CudaUnsupported(f"{plan.op}: {what} in a row op is not supported by the CUDA backend yet")


class _Rows:
    """The text of one kernel's RowBody: its row values, pass loops and the loop of results."""

    def __init__(self, plan: OpPlan, kernel: KernelPlan, namer: Namer, names: dict, types: dict):
        self.plan, self.kernel, self.body, self.names = plan, kernel, kernel.body, names
        self.types = types  # input or incoming gradient → its element type's template name
        self.printer = CudaPrinter()
        self.element = {v.local for i in kernel.inputs for v in i.values} | {m.local for m in kernel.masks}
        self.element |= set(kernel.incoming)
        temps = [*(item for p in self.body.passes for item in p.temps), *self.body.final_temps]
        self.temps = {t: e for t, e in temps}  # element temporaries (a pass and the results may share one)
        self.pointer = {i.name: namer.claim(f"{i.local}_ptr") for i in kernel.inputs}
        self.stride = {i.name: (namer.claim(f"{i.local}_stride_m"), namer.claim(f"{i.local}_stride_n"))
                       for i in kernel.inputs}
        self.incoming_pointer = {g: namer.claim(f"{g}_ptr") for g in kernel.incoming}
        self.incoming_stride = {g: (namer.claim(f"{g}_stride_m"), namer.claim(f"{g}_stride_n")) for g in kernel.incoming}
        # Values of one a row, loaded once at the row's start: integer inputs ([..., 1]: a class
        # index) in their own type, and the incoming gradients of outputs with one value a row.
        self.per_row = {v.local: (self.pointer[i.name], self.stride[i.name][0], types[i.name])
                        for i in kernel.inputs if not i.layout.differentiable for v in i.values}
        self.per_row.update({g: (self.incoming_pointer[g], self.incoming_stride[g][0], "T")
                             for (name, _), g in zip(plan.outputs, kernel.incoming) if name in plan.row_outputs})
        self.pack = {v: namer.claim(f"{v}_pack") for v in sorted(self.element | set(kernel.outputs)
                                                                 | {v for g in kernel.gradients for v in g.values})}
        self.held_at = {v: namer.claim(f"{v}_held") for v, _ in self.held()}
        self.threshold = {m.p.name: namer.claim(f"{m.p.local}_threshold") for m in kernel.masks}
        self.scale = {m.p.name: namer.claim(f"{m.p.local}_scale") for m in kernel.masks}
        self.printer.column = f"T({names['col']} + {names['k']})"
        self.printer.integers, self.printer.integer_column = integer_names(plan), f"({names['col']} + {names['k']})"
        self.printer.narrow_results("Narrow")  # _kernel_text defines it where the body reads it

    def text(self, expr) -> str:
        return self.printer.doprint(expr)

    def row_values(self, items) -> list[str]:
        return [f"const T {t.name} = {self.text(e)};" for t, e in items]

    def _needed(self, exprs) -> tuple[list, list, list, list]:
        """The element temporaries these expressions read (in order), and the inputs, masks and
        incoming gradients they reach."""
        wanted, pending = set(), [s for e in exprs for s in e.free_symbols]
        while pending:
            symbol = pending.pop()
            if symbol in self.temps and symbol not in wanted:
                wanted.add(symbol)
                pending.extend(self.temps[symbol].free_symbols)
        reached = {s.name for e in [*exprs, *(self.temps[t] for t in wanted)] for s in e.free_symbols}
        temps = [(t, e) for t, e in self.temps.items() if t in wanted]
        inputs = [i for i in self.kernel.inputs if any(v.local in reached for v in i.values)]
        masks = [m for m in self.kernel.masks if m.local in reached]
        incoming = [g for g in self.kernel.incoming if g in reached]
        return temps, inputs, masks, incoming

    def _reads(self, inputs, incoming) -> list[tuple]:
        """(value, pointer, strides, chunk) of each value these inputs and incoming gradients give."""
        reads = [(v.local, self.pointer[i.name], self.stride[i.name], c) for i in inputs for c, v in enumerate(i.values)]
        reads += [(g, self.incoming_pointer[g], self.incoming_stride[g], 0) for g in incoming]
        return [r for r in reads if r[0] not in self.per_row]  # those are loaded once a row

    def _load_lines(self, reads, masks, row: str) -> list[str]:
        """Each read's pack and each mask's multipliers at the pack's columns (col), from memory."""
        n = self.names
        col = n["col"]
        lines = [f"fusegen::load<Pack>({self.pack[v]}, {pointer} + {row} * {stride[0]} + "
                 f"{_column(col, c, n['N'])} * {stride[1]}, {stride[1]});" for v, pointer, stride, c in reads]
        lines += [f"fusegen::dropout_multipliers<Pack>({self.pack[m.local]}, {n['has_dropout']}, {n['seed']}, "
                  f"fusegen::flat_index({n['shard_ptr']}, {row}, {col}, {n['N']}), {m.stream}u, "
                  f"{self.threshold[m.p.name]}, {self.scale[m.p.name]});"
                  for m in masks]
        return lines

    def columns(self, inner: list[str]) -> list[str]:
        """The thread's packs along the row, `inner` at each: Threads · Pack columns apart, the
        pack's first column at col."""
        n = self.names
        col = n["col"]
        return [f"for (Index {col} = {n['begin']} + Index(threadIdx.x) * Pack; {col} < {n['end']}; "
                f"{col} += Index(Threads) * Pack) {{",
                *(f"  {line}" if not line.startswith("#") else line for line in inner), "}"]

    def here(self, held: str) -> str:
        """The pack at col (the thread's item) of a held row."""
        n = self.names
        return f"{held}.at({n['item']}, {n['col']} - {n['begin']})"

    def items(self, inner: list[str], unroll: str = "") -> list[str]:
        """As columns, pack by pack (`item`): where the row is held (Whole), over the Items packs a
        thread holds, unrolled (or by `unroll`), so that their loads are in flight at once and a
        thread's arrays indexed by item stay in registers."""
        n = self.names
        item, col = n["item"], n["col"]
        at = f"{n['begin']} + (Index({item}) * Threads + threadIdx.x) * Pack"
        return [f"#pragma unroll{unroll}", f"for (int {item} = 0; Whole ? {item} < Items : {at} < {n['end']}; ++{item}) {{",
                f"  const Index {col} = {at};",
                f"  if ({col} < {n['end']}) {{", *(f"    {line}" if not line.startswith("#") else line for line in inner),
                "  }", "}"]

    def held(self) -> list[tuple[str, str]]:
        """What a kernel holds where the row is held, (value, element type): each value with rows
        that its passes read (inputs, incoming gradients, as stored) and the masks they read (a
        byte an element: kept or not). The forward also holds the [N] inputs its passes read (read
        once a row, not once a pass) and the rows only its results read (their loads in flight
        with the row's, where a results loop that draws masks goes item by item): H100, bf16
        (16384, 8192), bias_layernorm's forward 0.2285 -> 0.2188 ms, layernorm_dropout_add's
        0.4570 -> 0.4068. The backward reads those from memory where used (cached)."""
        _, inputs, masks, incoming = self._needed([r.value for p in self.body.passes for r in p.reductions])
        forward = self.kernel is self.plan.forward
        reads = [(v.local, self.types[i.name]) for i in inputs if forward or _has_rows(i) for v in i.values]
        if forward:
            _, results, _, _ = self._needed([e for _, e in self.body.results])  # the results loop's reads
            reads += [(v.local, self.types[i.name]) for i in results if _has_rows(i) and i not in inputs
                      for v in i.values]
        reads += [(g, self.types[g]) for g in incoming]
        return [r for r in reads if r[0] not in self.per_row] + [(m.local, "unsigned char") for m in masks]

    def held_arrays(self) -> list[str]:
        """The held rows: in registers, or their places in shared memory, in order."""
        n = self.names
        return [f"fusegen::Held<{t}, Pack, Items, Registers> {name}({n['next']}, Threads * Items * Pack);"
                for name, t in [(self.held_at[v], t) for v, t in self.held()]]

    def per_row_loads(self) -> list[str]:
        """The row's values of one a row (per_row), at its start."""
        row, lines = self.names["row"], []
        for v, (pointer, stride, t) in self.per_row.items():
            value = f"{pointer}[{row} * {stride}]"
            lines.append(f"const {t} {v} = {f'T({value})' if t == 'T' else value};")
        return lines

    def row_copies(self) -> list[str]:
        """With the row held (Whole): each value's packs loaded into its Held at the row's start (all
        unrolled: every item's loads in flight at once)."""
        n = self.names
        held = {v for v, _ in self.held()}
        lines = [f"fusegen::copy<Pack>({self.here(self.held_at[v])}, {pointer} + {n['row']} * {stride[0]} + "
                 f"{_column(n['col'], c, n['N'])} * {stride[1]}, {stride[1]});"
                 for v, pointer, stride, c in self._reads(self.kernel.inputs, self.kernel.incoming) if v in held]
        for m in (m for m in self.kernel.masks if m.local in held):
            lines += [f"T {self.pack[m.local]}[Pack];", *self._load_lines((), [m], n["row"]),
                      f"fusegen::store_kept<Pack>({self.here(self.held_at[m.local])}, {self.pack[m.local]});"]
        if not lines:
            return []
        return ["if (Whole) {  // the row's values held", *_indent(self.items(lines)), "}"]

    def loop(self, exprs, inner: list[str], after: list[str] = (), declared: list[str] = (),
             by_item: bool = False) -> list[str]:
        """A loop along the row: each pack's values that `exprs` read (from the held row where it is
        held, else from memory), then per element (k) those values and the temporaries,
        then `inner`; `after`, once a pack; `declared` first. `by_item`: the loop of `items`, as is
        every loop that reads a held row; one that draws dropout's masks there is unrolled only
        where the row is in registers (which needs it): Philox's words for every item at once took
        bf16 layernorm_dropout_add's forward to 80 registers a thread (H100: 3 blocks an SM)."""
        n = self.names
        k = n["k"]
        temps, inputs, masks, incoming = self._needed(exprs)
        reads = self._reads(inputs, incoming)
        values = [v for v, *_ in reads] + [m.local for m in masks]
        held = [v for v in values if v in self.held_at]
        body = [*declared, f"T {', '.join(f'{self.pack[v]}[Pack]' for v in values)};"] if values else list(declared)
        held_reads = [r for r in reads if r[0] in self.held_at]
        loads = self._load_lines(held_reads, [m for m in masks if m.local in self.held_at], n["row"])
        if held:
            scale = {m.local: self.scale[m.p.name] for m in masks}
            body += ["if (Whole) {", *(f"  fusegen::load<Pack>({self.pack[v]}, {self.here(self.held_at[v])}, Index(1));"
                                        if v not in scale else
                                        f"  fusegen::load_kept<Pack>({self.pack[v]}, {self.here(self.held_at[v])}, "
                                        f"{n['has_dropout']}, {scale[v]});" for v in held),
                     "} else {", *_indent(loads), "}"]
        body += self._load_lines([r for r in reads if r[0] not in self.held_at],  # read once a row, or [N] (cached)
                                 [m for m in masks if m.local not in self.held_at], n["row"])
        body += ["#pragma unroll", f"for (int {k} = 0; {k} < Pack; ++{k}) {{"]
        body += [f"  const T {v} = {self.pack[v]}[{k}];" for v in values]
        body += [f"  const T {t.name} = {self.text(e)};" for t, e in temps]
        body += [f"  {line}" for line in inner] + ["}", *after]
        if by_item or held:  # a held pack by its item
            draws = any(m.local not in self.held_at for m in masks)
            return self.items(body, " (Registers ? Items : 1)" if draws and not by_item else "")
        return self.columns(body)

    def passes(self, statistics: str | None) -> list[str]:
        """Each pass: its reductions (an online sum in a loop after its extreme's), reduced across
        the block, the forward's kept; then the row values they make ready."""
        lines = []
        places = {s: k for k, s in enumerate(self.body.statistics)}
        count = len(self.body.statistics)
        for number, p in enumerate(self.body.passes, 1):
            lines.append(f"// pass {number} along the row")
            groups = [[r for r in p.reductions if r.running is None], [r for r in p.reductions if r.running is not None]]
            for group in filter(None, groups):
                lines += [f"T {r.symbol.name} = {_NEUTRAL[r.op]};" for r in group]
                lines += self.loop([r.value for r in group], [_accumulate(r.op, r.symbol.name, self.text(r.value))
                                                            for r in group])
                n = self.names
                reduced = {r: f"{_REDUCE[r.op]}<Cluster>({r.symbol.name}, {n['shared']}, {n['slots']}, {n['phase']})"
                           for r in group}
                lines += [f"{r.symbol.name} = " + (f"fusegen::divide({reduced[r]}, T({n['N']}));" if r.op == "mean" else
                                                    f"{reduced[r]};") for r in group]
            if statistics is not None:
                lines += [f"if (threadIdx.x == 0 && {self.names['begin']} == 0) "
                          f"{statistics}[{_statistic(self.names['row'], count, places[r.symbol])}] = "
                          f"{r.symbol.name};" for r in p.reductions if r.symbol in places]
            lines += self.row_values(p.row_values)
        return lines


def _has_rows(i) -> bool:
    """An input with a row dim of its own ([..., N]), not one row broadcast to all ([N])."""
    dims = i.layout.dims
    return len(dims) > 1 or dims[:1] == ("...",)


def _statistic(row: str, count: int, k: int) -> str:
    """Statistic k of the row in the [M, count] buffer."""
    return (row if count == 1 else f"{row} * {count}") + (f" + {k}" if k else "")


def _accumulate(op: str, total: str, value: str) -> str:
    if op in ("max", "min"):
        return f"{total} = fusegen::{'maximum' if op == 'max' else 'minimum'}<T>({total}, {value});"
    return f"{total} += {value};"


def _namer(plan: OpPlan, kernel: KernelPlan) -> tuple[Namer, dict]:
    """The kernel's namer (every name of both kernels' bodies taken) and its own names."""
    locals_ = _locals_of(plan.forward) | _locals_of(plan.backward)
    _check(plan, locals_, row_kind=True)
    namer = Namer(frozenset(locals_) | OWN_NAMES | CPP_KEYWORDS | {f"{plan.op}_forward", f"{plan.op}_backward"})
    names = {w: namer.claim(w) for w in ("row", "col", "k", "N", "M", "seed", "has_dropout", "seed_ptr", "shard_ptr",
                                         "shared", "statistics_ptr", "first", "next", "item",
                                         "rank", "rows_each", "first_row", "last_row", "begin", "end", "slots",
                                         "phase")}
    return namer, names


def _locals_of(kernel: KernelPlan) -> set[str]:
    body = kernel.body
    names = {v.local for i in kernel.inputs for v in i.values} | set(kernel.outputs) | set(kernel.incoming)
    names |= {p.local for p in kernel.scalars} | {m.local for m in kernel.masks}
    names |= {v for g in kernel.gradients for v in g.values}
    names |= {s.name for s, _ in body.definitions} | {r.symbol.name for r in body.reductions}
    names |= {s.name for s, _ in body.loaded} | {name for name, _ in body.results}
    return names | ({kernel.row_width} if kernel.row_width else set())


def _rows(plan: OpPlan, kernel: KernelPlan) -> tuple[_Rows, Namer, dict, dict]:
    """A kernel's _Rows, namer, own names and element types' template names (inputs', then
    incoming gradients')."""
    namer, n = _namer(plan, kernel)
    element_type = {i.name: namer.claim(f"{i.local.capitalize()}Type") for i in kernel.inputs}
    element_type.update({g: namer.claim(f"{g.capitalize()}Type") for g in kernel.incoming})
    return _Rows(plan, kernel, namer, n, element_type), namer, n, element_type


def forward_source(plan: OpPlan) -> str:
    """The forward kernel of <op>.cu."""
    _refuse(plan)
    kernel = plan.forward
    rows, namer, n, element_type = _rows(plan, kernel)
    out_pointer = {o: namer.claim(f"{o}_ptr") for o in kernel.outputs}
    out_type = {o: namer.claim(f"{o.capitalize()}Type") for o in kernel.outputs}
    count = len(kernel.body.statistics)
    parameters = [f"const {element_type[i.name]}* __restrict__ {rows.pointer[i.name]}, Index {rows.stride[i.name][0]}, "
                  f"Index {rows.stride[i.name][1]},  // {i.name} {i.layout.declared}, as [M, N]" for i in kernel.inputs]
    parameters += [f"{out_type[o]}* __restrict__ {out_pointer[o]},  // {name}, contiguous "
                   f"[M, {'1' if name in plan.row_outputs else 'N'}]" for (name, _), o in zip(plan.outputs, kernel.outputs)]
    parameters.append(f"T* __restrict__ {n['statistics_ptr']},  // [M, {count}]: each row's reductions, kept for the backward")
    parameters += [f"{scalar_type(p)} {p.local},  // param {p.name}" for p in kernel.scalars]
    parameters += _dropout_parameters(kernel, n["seed_ptr"], n["has_dropout"], rows.threshold, rows.scale,
                                      n["shard_ptr"])
    results = dict(kernel.body.results)
    per_row = [o for (name, _), o in zip(plan.outputs, kernel.outputs) if name in plan.row_outputs]
    outputs = [o for o in kernel.outputs if o not in per_row]
    stores = [f"fusegen::store<Pack>({out_pointer[o]} + {n['row']} * {n['N']} + {n['col']}, {rows.pack[o]});"
              for o in outputs]
    final = [f"{rows.pack[o]}[{n['k']}] = {rows.text(results[o])};" for o in outputs]
    types = [*element_type.values(), *out_type.values()]
    body = [*rows.row_values(kernel.body.row_values), *rows.passes(n["statistics_ptr"])]
    if per_row:  # constant along the row: computed and stored once, by the row's first thread
        body += [f"if (threadIdx.x == 0 && {n['begin']} == 0) {{  // the outputs of one value a row",
                 *(f"  {out_pointer[o]}[{n['row']}] = fusegen::to<{out_type[o]}>(T({rows.text(results[o])}));"
                   for o in per_row), "}"]
    if outputs:
        body += ["// the results, element by element",
                 *_results_loop(rows, [results[o] for o in outputs], outputs, final, stores)]
    return _kernel_text(rows, f"{plan.op}_forward", types, parameters, body, list(out_type.values()), prologue=[
        *outdir.header_lines(plan.op, plan.spec_path, "//"),
        f"// spec sha256: {plan.spec_sha256}",
        f"// {plan.doc}",
        '#include "fusegen_cuda.cuh"',
        ""])


def _results_loop(rows: _Rows, exprs, values, inner: list[str], after: list[str], by_item: bool = False) -> list[str]:
    """The loop of results: each value's pack of the item, stored by `after`."""
    return rows.loop(exprs, inner, after, declared=[f"T {', '.join(f'{rows.pack[v]}[Pack]' for v in values)};"],
                     by_item=by_item)


def _kernel_text(rows: _Rows, name: str, types, parameters, body, results, prologue=(), before=(),
                 after=()) -> str:
    """The kernel: its template and parameters, then `before` the rows, `body` at each row (after
    the row's loads into its Held where it is held), `after` them. `results`: the element types
    the kernel writes (Narrow, where the body's exp reads it: all 16-bit or narrower)."""
    kernel, n = rows.kernel, rows.names
    template = ", ".join(["typename T", "typename Index", "int Pack", "int Threads", "int Items", "int Cluster",
                          "bool Registers", *(f"typename {t}" for t in types)])
    seed = [f"const uint64_t {n['seed']} = {n['has_dropout']} ? uint64_t(*{n['seed_ptr']}) : 0u;"] if kernel.masks else []
    width = [f"const T {kernel.row_width} = T({n['N']});"] if kernel.row_width else []
    narrow = f"fusegen::narrow<{', '.join(results)}>()" if results else "false"
    held = rows.held_arrays()
    if held:
        held = [f"unsigned char* {n['next']} = fusegen::dynamic_shared();  // Whole, not Registers: Threads · Items · "
                "Pack of each", *held]
    lines = [
        *prologue,
        "#ifdef __CUDACC__",
        "// A block of Threads a run of adjacent rows, one at a time; each pass a loop along the row,",
        "// Pack adjacent columns a thread Threads · Pack apart, its reductions then reduced across the",
        "// block. Items > 0: the row held, each thread's Items packs loaded once a row, in its",
        "// registers (Registers) or in shared memory; Cluster > 1: a cluster of blocks a row, each",
        "// holding Threads · Items · Pack columns of it, their reductions combined through the",
        "// cluster's shared memory (sm_90).",
        f"template <{template}>",
        f"__global__ void __launch_bounds__(Threads) {name}(",
        *(f"    {p}" for p in parameters),
        f"    Index {n['M']}, Index {n['N']},",
        f"    Index {n['rows_each']}) {{  // a block's run of rows: M over the grid's blocks (clusters), rounded up",
        "  constexpr bool Whole = Items > 0;",
        *([f"  constexpr bool Narrow = {narrow};  // results 16-bit or narrower: a faster exp"]
          if any("<Narrow>" in line for line in body) else []),
        "  static_assert((Cluster == 1 && !Registers) || Whole, \"a cluster, or registers, hold the row\");",
        f"  __shared__ T {n['shared']}[32];  // a block's reduction: a value a warp",
        f"  __shared__ T {n['slots']}[2 * Cluster];  // a cluster's: a value a block, the last two reductions'",
        f"  unsigned {n['phase']} = 0;  // reductions so far",
        f"  const Index {n['rank']} = Index(blockIdx.x / Cluster);  // the block's (its cluster's) place: its row of sums",
        f"  const Index {n['first_row']} = {n['rank']} * {n['rows_each']};  // rows side by side, a block's a run of them",
        f"  const Index {n['last_row']} = {n['rows_each']} < {n['M']} - {n['first_row']} ? {n['first_row']} + "
        f"{n['rows_each']} : {n['M']};  // (first_row + rows_each could pass Index)",
        f"  const Index {n['begin']} = Index(blockIdx.x % Cluster) * (Threads * Items * Pack);  // the block's columns",
        f"  const Index {n['end']} = Cluster > 1 && {n['begin']} + Threads * Items * Pack < {n['N']} ? "
        f"{n['begin']} + Threads * Items * Pack : {n['N']};",
        *_indent(seed + width + held + list(before)),
        "  if (Cluster > 1) fusegen::cluster_sync();  // every block of the cluster started: its shared memory there",
        f"  for (Index {n['row']} = {n['first_row']}; {n['row']} < {n['last_row']}; ++{n['row']}) {{",
        *_indent(_indent(rows.per_row_loads() + rows.row_copies() + body)),
        "  }",
        *_indent(list(after)),
        "  if (Cluster > 1) fusegen::cluster_sync();  // no block leaves while another may still write to it",
        "}",
        "#endif",
    ]
    return "\n".join(lines) + "\n"


def backward_source(plan: OpPlan) -> str:
    """The backward kernel of <op>.cu."""
    _refuse(plan)
    kernel = plan.backward
    rows, namer, n, element_type = _rows(plan, kernel)
    base = {g.input.name: g.values[0] for g in kernel.gradients}
    grad_pointer = {g.input.name: namer.claim(f"{base[g.input.name]}_ptr") for g in kernel.gradients}
    grad_type = {g.input.name: namer.claim(f"{base[g.input.name].capitalize()}Type") for g in kernel.gradients}
    sums = {g.input.name: namer.claim(f"{base[g.input.name]}_sums") for g in kernel.gradients}
    count = len(plan.forward.body.statistics)
    parameters = [f"const {element_type[i.name]}* __restrict__ {rows.pointer[i.name]}, Index {rows.stride[i.name][0]}, "
                  f"Index {rows.stride[i.name][1]},  // {i.name} {i.layout.declared}, as [M, N]" for i in kernel.inputs]
    parameters += [f"const {element_type[g]}* __restrict__ {rows.incoming_pointer[g]}, Index {rows.incoming_stride[g][0]}, "
                   f"Index {rows.incoming_stride[g][1]},  // the incoming gradient of {name}, as [M, N]"
                   for (name, _), g in zip(plan.outputs, kernel.incoming)]
    parameters.append(f"const T* __restrict__ {n['statistics_ptr']},  // [M, {count}]: the forward's reductions")
    parameters += [f"{scalar_type(p)} {p.local},  // param {p.name}" for p in kernel.scalars]
    parameters += _dropout_parameters(kernel, n["seed_ptr"], n["has_dropout"], rows.threshold, rows.scale,
                                      n["shard_ptr"])
    parameters += [f"{grad_type[g.input.name]}* __restrict__ {grad_pointer[g.input.name]}, bool {sums[g.input.name]},"
                   f"  // {base[g.input.name]}: [M, {_width(len(g.values), 'N')}], or with {sums[g.input.name]} its sums "
                   "over each block's rows, [blocks, ...] in T; null where not wanted" for g in kernel.gradients]
    results = dict(kernel.body.results)
    gradients = [v for g in kernel.gradients for v in g.values]
    final = [f"{rows.pack[v]}[{n['k']}] = {rows.text(results[v])};" for v in gradients]
    stores, totals, sums_stores = [], [], []
    for g in kernel.gradients:
        name, width = g.input.name, _width(len(g.values), n["N"])
        for c, v in enumerate(g.values):  # an input in chunks: a gradient a chunk, at its columns
            column = _column(n["col"], c, n["N"])
            summed = [f"}} else if ({sums[name]}) {{",
                      f"  fusegen::accumulate<Pack>({grad_pointer[name]} + {n['rank']} * {width} + {column}, "
                      f"{rows.pack[v]}, {n['first']});"]
            written = [f"}} else if ({grad_pointer[name]} != nullptr) {{",
                       f"  fusegen::store<Pack>({grad_pointer[name]} + {n['row']} * {width} + {column}, {rows.pack[v]});", "}"]
            if _has_rows(g.input):  # summed only where the caller broadcasts it: in its buffer, not held
                stores += [f"if ({sums[name]}) {{", *summed[1:], *written]
                continue
            # An [N] input's, where the row is held: summed in the thread's registers (its columns
            # are the same every row), stored once after the rows.
            total = namer.claim(f"{v}_total")
            totals.append(f"T {total}[Whole ? Items : 1][Pack] = {{}};  // {v} over the block's rows, held")
            stores += [f"if ({sums[name]} && Whole) {{",
                       f"  fusegen::add<Pack>({total}[{n['item']}], {rows.pack[v]});", *summed, *written]
            sums_stores += [f"if (Whole && {sums[name]}) {{",
                            *_indent(rows.items([f"fusegen::store<Pack>({grad_pointer[name]} + {n['rank']} * "
                                                 f"{width} + {column}, {total}[{n['item']}]);"])), "}"]
    loaded = [f"const T {s.name} = {n['statistics_ptr']}[{_statistic(n['row'], count, k)}];" for s, k in kernel.body.loaded]
    body = [f"const bool {n['first']} = {n['row']} == {n['first_row']};  // the block's first row: its sums start here",
            *loaded, *rows.row_values(kernel.body.row_values), *rows.passes(None), "// the gradients, element by element",
            *_results_loop(rows, [results[v] for v in gradients], gradients, final, stores, by_item=bool(totals))]
    types = [*element_type.values(), *grad_type.values()]
    return _kernel_text(rows, f"{plan.op}_backward", types, parameters, body, list(grad_type.values()), before=totals,
                        after=["// held rows: the block's sums, once", *sums_stores] if sums_stores else [])


def held_arrays(plan: OpPlan) -> tuple[tuple, tuple]:
    """What each kernel holds where the row is held (_Rows.held), each as the place of its element
    type among the kernel's template types after Registers, or the type ("T", "unsigned char"):
    the launcher's registers or shared memory a block."""
    found = []
    for kernel in (plan.forward, plan.backward):
        rows, _, _, element_type = _rows(plan, kernel)
        places = {name: k for k, name in enumerate(element_type.values())}
        held = [places.get(t, t) for _, t in rows.held()]
        found.append(tuple(held) if kernel is plan.forward or not plan.forward_only else ())
    return tuple(found)


def source(plan: OpPlan) -> str:
    """The whole of <op>.cu: the forward, then the backward (none for an op without gradients)."""
    return forward_source(plan) + ("" if plan.forward_only else "\n" + backward_source(plan))

