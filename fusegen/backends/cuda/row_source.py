"""The row kind's kernels in CUDA C++ (issue 33): the plan's RowBody, a block a row.

A block of Threads takes rows blockIdx.x, blockIdx.x + gridDim.x, ...; each pass of the body is a
loop along the row, a thread taking packs of Pack adjacent columns Threads · Pack apart (vector
loads where the launcher's views allow, as the pointwise kind's: pointwise_source), its
reductions accumulated in each thread and then across the block (fusegen::block_reduce). A
pass's online sums (softmax's Σ exp(x - max)) take a loop of their own after their extreme is
known. With Items > 0 the row is held: each thread's Items packs of every value the kernel reads
loaded once a row (an [N] input's once a block) and every pass runs over those registers; with
Items 0 each pass reads the row again. The forward keeps each row's reductions ([M, statistics],
in T) for the backward, which reads them back and computes each gradient element by element:
written, or summed over the block's rows where its input is one row broadcast to all (in
registers where the row is held, else in the block's row of a [blocks, N] buffer; torch adds the
blocks' rows up in order: deterministic).

Not yet: outputs with one value a row, outputs of their own dtype (float8), inputs in chunks,
choice params, integer inputs (each a one-line CudaUnsupported); online sums in one loop where
the row is read again; clusters for wide rows."""
from __future__ import annotations

from fusegen import outdir
from fusegen.names import Namer
from fusegen.plan import KernelPlan, OpPlan

from .pointwise_source import CPP_KEYWORDS, OWN_NAMES, CudaUnsupported, _check, _column, _dropout_parameters, _indent
from .printer import CudaPrinter

_NEUTRAL = {"sum": "T(0)", "mean": "T(0)", "max": "-fusegen::infinity<T>()", "min": "fusegen::infinity<T>()"}
_REDUCE = {"sum": "fusegen::block_sum", "mean": "fusegen::block_sum", "max": "fusegen::block_max",
           "min": "fusegen::block_min"}


def _refuse(plan: OpPlan) -> None:
    what = ("an output with one value a row" if plan.row_outputs else
            "an input in chunks" if any(i.layout.chunks > 1 for i in plan.inputs) else
            "an output in parts" if plan.output_parts else
            "a choice param" if plan.helpers else
            "an op without a backward" if plan.forward_only else None)
    if what is not None:
        raise CudaUnsupported(f"{plan.op}: {what} in a row op is not supported by the CUDA backend yet")


class _Rows:
    """The text of one kernel's RowBody: its row values, pass loops and the loop of results."""

    def __init__(self, plan: OpPlan, kernel: KernelPlan, namer: Namer, names: dict):
        self.plan, self.kernel, self.body, self.names = plan, kernel, kernel.body, names
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
        self.pack = {v: namer.claim(f"{v}_pack") for v in sorted(self.element | set(kernel.outputs)
                                                                 | {v for g in kernel.gradients for v in g.values})}
        self.threshold = {m.p.name: namer.claim(f"{m.p.local}_threshold") for m in kernel.masks}
        self.scale = {m.p.name: namer.claim(f"{m.p.local}_scale") for m in kernel.masks}
        self.printer.column = f"T({names['col']} + {names['k']})"

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
        return reads + [(g, self.incoming_pointer[g], self.incoming_stride[g], 0) for g in incoming]

    def _load_lines(self, reads, masks, row: str) -> list[str]:
        """Each read's pack and each mask's multipliers at the item's columns, into [item]."""
        n = self.names
        col, item = n["col"], n["item"]
        lines = [f"fusegen::load<Pack>({self.pack[v]}[{item}], {pointer} + {row} * {stride[0]} + "
                 f"{_column(col, c, n['N'])} * {stride[1]}, {stride[1]});" for v, pointer, stride, c in reads]
        lines += [f"fusegen::dropout_multipliers<Pack>({self.pack[m.local]}[{item}], {n['has_dropout']}, {n['seed']}, "
                  f"int64_t({row}) * {n['N']} + {col}, {m.stream}u, {self.threshold[m.p.name]}, {self.scale[m.p.name]});"
                  for m in masks]
        return lines

    def columns(self, inner: list[str]) -> list[str]:
        """The thread's packs along the row, `inner` at each: Packs a tile, Threads · Pack apart, the
        row's first column at col."""
        n = self.names
        first, item, col = n["first_col"], n["item"], n["col"]
        return [f"for (Index {first} = 0; {first} < {n['N']}; {first} += Index(Threads) * Packs * Pack) {{",
                "#pragma unroll",
                f"  for (int {item} = 0; {item} < Packs; ++{item}) {{",
                f"    const Index {col} = {first} + (Index({item}) * Threads + threadIdx.x) * Pack;",
                f"    if ({col} < {n['N']}) {{", *(f"      {line}" if not line.startswith("#") else line for line in inner),
                "    }", "  }", "}"]

    def held(self) -> list[tuple]:
        """What a kernel holds a pack of for each item: every value it reads and its masks."""
        reads = self._reads(self.kernel.inputs, self.kernel.incoming)
        return [v for v, *_ in reads] + [m.local for m in self.kernel.masks]

    def whole_row(self) -> tuple[list[str], list[str]]:
        """With the row held (Whole): the loads of the [N] inputs once a block, and of the rest at
        each row's start."""
        n = self.names
        columns = [i for i in self.kernel.inputs if not _has_rows(i)]
        rows = [i for i in self.kernel.inputs if _has_rows(i)]
        once = self._load_lines(self._reads(columns, ()), (), "Index(0)")
        each = self._load_lines(self._reads(rows, self.kernel.incoming), self.kernel.masks, n["row"])
        return (["if (Whole) {", *_indent(self.columns(once)), "}"] if once else [],
                ["if (Whole) {", *_indent(self.columns(each)), "}"] if each else [])

    def loop(self, exprs, inner: list[str], after: list[str] = (), declared: list[str] = ()) -> list[str]:
        """A loop along the row: each pack's values that `exprs` read (loaded here unless the row is
        held), then per element (k) those values and the temporaries, then `inner`; `after`, once
        a pack; `declared` first."""
        n = self.names
        item, k = n["item"], n["k"]
        temps, inputs, masks, incoming = self._needed(exprs)
        reads = self._reads(inputs, incoming)
        loads = self._load_lines(reads, masks, n["row"])
        body = [*declared, *(["if (!Whole) {", *_indent(loads), "}"] if loads else [])]
        body += ["#pragma unroll", f"for (int {k} = 0; {k} < Pack; ++{k}) {{"]
        body += [f"  const T {v} = {self.pack[v]}[{item}][{k}];" for v, *_ in reads + [(m.local,) for m in masks]]
        body += [f"  const T {t.name} = {self.text(e)};" for t, e in temps]
        body += [f"  {line}" for line in inner] + ["}", *after]
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
                lines += [f"{r.symbol.name} = " + (f"fusegen::divide({_REDUCE[r.op]}({r.symbol.name}, {self.names['shared']}), "
                                                    f"T({self.names['N']}));" if r.op == "mean" else
                                                    f"{_REDUCE[r.op]}({r.symbol.name}, {self.names['shared']});")
                          for r in group]
            if statistics is not None:
                lines += [f"if (threadIdx.x == 0) {statistics}[{_statistic(self.names['row'], count, places[r.symbol])}] = "
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
    _check(plan, locals_)
    namer = Namer(frozenset(locals_) | OWN_NAMES | CPP_KEYWORDS | {f"{plan.op}_forward", f"{plan.op}_backward"})
    names = {w: namer.claim(w) for w in ("row", "col", "k", "N", "M", "seed", "has_dropout", "seed_ptr", "shared",
                                         "statistics_ptr", "first", "first_col", "item")}
    return namer, names


def _locals_of(kernel: KernelPlan) -> set[str]:
    body = kernel.body
    names = {v.local for i in kernel.inputs for v in i.values} | set(kernel.outputs) | set(kernel.incoming)
    names |= {p.local for p in kernel.scalars} | {m.local for m in kernel.masks}
    names |= {v for g in kernel.gradients for v in g.values}
    names |= {s.name for s, _ in body.definitions} | {r.symbol.name for r in body.reductions}
    names |= {s.name for s, _ in body.loaded} | {name for name, _ in body.results}
    return names | ({kernel.row_width} if kernel.row_width else set())


def forward_source(plan: OpPlan) -> str:
    """The forward kernel of <op>.cu."""
    _refuse(plan)
    kernel = plan.forward
    namer, n = _namer(plan, kernel)
    rows = _Rows(plan, kernel, namer, n)
    out_pointer = {o: namer.claim(f"{o}_ptr") for o in kernel.outputs}
    element_type = {i.name: namer.claim(f"{i.local.capitalize()}Type") for i in kernel.inputs}
    out_type = {o: namer.claim(f"{o.capitalize()}Type") for o in kernel.outputs}
    count = len(kernel.body.statistics)
    parameters = [f"const {element_type[i.name]}* __restrict__ {rows.pointer[i.name]}, Index {rows.stride[i.name][0]}, "
                  f"Index {rows.stride[i.name][1]},  // {i.name} {i.layout.declared}, as [M, N]" for i in kernel.inputs]
    parameters += [f"{out_type[o]}* __restrict__ {out_pointer[o]},  // {name}, contiguous [M, N]"
                   for (name, _), o in zip(plan.outputs, kernel.outputs)]
    parameters.append(f"T* __restrict__ {n['statistics_ptr']},  // [M, {count}]: each row's reductions, kept for the backward")
    parameters += [f"T {p.local},  // param {p.name}" for p in kernel.scalars]
    parameters += _dropout_parameters(kernel, n["seed_ptr"], n["has_dropout"], rows.threshold, rows.scale)
    results = dict(kernel.body.results)
    stores = [f"fusegen::store<Pack>({out_pointer[o]} + {n['row']} * {n['N']} + {n['col']}, {rows.pack[o]});"
              for o in kernel.outputs]
    final = [f"{rows.pack[o]}[{n['k']}] = {rows.text(results[o])};" for o in kernel.outputs]
    types = [*element_type.values(), *out_type.values()]
    body = [*rows.row_values(kernel.body.row_values), *rows.passes(n["statistics_ptr"]), "// the results, element by element",
            *_results_loop(rows, [results[o] for o in kernel.outputs], kernel.outputs, final, stores)]
    return _kernel_text(rows, f"{plan.op}_forward", types, parameters, body, prologue=[
        *outdir.header_lines(plan.op, plan.spec_path, "//"),
        f"// spec sha256: {plan.spec_sha256}",
        f"// {plan.doc}",
        '#include "fusegen_cuda.cuh"',
        ""])


def _results_loop(rows: _Rows, exprs, values, inner: list[str], after: list[str]) -> list[str]:
    """The loop of results: each value's pack of the item, stored by `after`."""
    return rows.loop(exprs, inner, after, declared=[f"T {', '.join(f'{rows.pack[v]}[Pack]' for v in values)};"])


def _kernel_text(rows: _Rows, name: str, types, parameters, body, prologue=(), before=(), after=()) -> str:
    """The kernel: its template and parameters, then `before` the rows, `body` at each row (with
    the row's held packs declared, and loaded where the row is held), `after` them."""
    kernel, n = rows.kernel, rows.names
    template = ", ".join(["typename T", "typename Index", "int Pack", "int Threads", "int Items",
                          *(f"typename {t}" for t in types)])
    seed = [f"const uint64_t {n['seed']} = {n['has_dropout']} ? uint64_t(*{n['seed_ptr']}) : 0u;"] if kernel.masks else []
    width = [f"const T {kernel.row_width} = T({n['N']});"] if kernel.row_width else []
    once, each = rows.whole_row()
    held = [f"T {', '.join(f'{rows.pack[v]}[Packs][Pack]' for v in rows.held())};"]
    lines = [
        *prologue,
        "#ifdef __CUDACC__",
        "// A block of Threads a row at a time; each pass a loop along the row, Pack adjacent columns a",
        "// thread Threads · Pack apart, its reductions then reduced across the block. Items > 0: the",
        "// row held in registers, each thread's Items packs loaded once (the [N] inputs once a block).",
        f"template <{template}>",
        f"__global__ void __launch_bounds__(Threads) {name}(",
        *(f"    {p}" for p in parameters),
        f"    Index {n['M']}, Index {n['N']}) {{",
        "  constexpr bool Whole = Items > 0;",
        "  constexpr int Packs = Whole ? Items : 1;  // a thread's packs a tile (the whole row's, held)",
        f"  __shared__ T {n['shared']}[32];  // a block's reduction: a value a warp",
        *_indent(seed + width + held + once + list(before)),
        f"  for (Index {n['row']} = blockIdx.x; {n['row']} < {n['M']}; {n['row']} += gridDim.x) {{",
        *_indent(_indent(each + body)),
        "  }",
        *_indent(list(after)),
        "}",
        "#endif",
    ]
    return "\n".join(lines) + "\n"


def backward_source(plan: OpPlan) -> str:
    """The backward kernel of <op>.cu."""
    _refuse(plan)
    kernel = plan.backward
    namer, n = _namer(plan, kernel)
    rows = _Rows(plan, kernel, namer, n)
    element_type = {i.name: namer.claim(f"{i.local.capitalize()}Type") for i in kernel.inputs}
    element_type.update({g: namer.claim(f"{g.capitalize()}Type") for g in kernel.incoming})
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
    parameters += [f"T {p.local},  // param {p.name}" for p in kernel.scalars]
    parameters += _dropout_parameters(kernel, n["seed_ptr"], n["has_dropout"], rows.threshold, rows.scale)
    parameters += [f"{grad_type[g.input.name]}* __restrict__ {grad_pointer[g.input.name]}, bool {sums[g.input.name]},"
                   f"  // {base[g.input.name]}: [M, N], or with {sums[g.input.name]} its sums over each block's rows, "
                   "[blocks, N] in T; null where not wanted" for g in kernel.gradients]
    results = dict(kernel.body.results)
    gradients = [g.values[0] for g in kernel.gradients]
    final = [f"{rows.pack[v]}[{n['k']}] = {rows.text(results[v])};" for v in gradients]
    stores, totals, sums_stores = [], [], []
    for g in kernel.gradients:
        name, v = g.input.name, g.values[0]
        summed = [f"}} else if ({sums[name]}) {{",
                  f"  fusegen::accumulate<Pack>({grad_pointer[name]} + Index(blockIdx.x) * {n['N']} + {n['col']}, "
                  f"{rows.pack[v]}, {n['first']});"]
        written = [f"}} else if ({grad_pointer[name]} != nullptr) {{",
                   f"  fusegen::store<Pack>({grad_pointer[name]} + {n['row']} * {n['N']} + {n['col']}, {rows.pack[v]});", "}"]
        if _has_rows(g.input):  # summed only where the caller broadcasts it: in its buffer, not held
            stores += [f"if ({sums[name]}) {{", *summed[1:], *written]
            continue
        # An [N] input's: summed in registers where the row is held, stored once after the rows.
        total = namer.claim(f"{v}_total")
        totals.append(f"T {total}[Packs][Pack] = {{}};  // held rows: {v}'s sums over the block's rows")
        stores += [f"if ({sums[name]} && Whole) {{", "#pragma unroll",
                   f"  for (int {n['k']} = 0; {n['k']} < Pack; ++{n['k']}) {total}[{n['item']}][{n['k']}] += "
                   f"{rows.pack[v]}[{n['k']}];", *summed, *written]
        sums_stores += [f"if (Whole && {sums[name]}) {{",
                        *_indent(rows.columns([f"fusegen::store<Pack>({grad_pointer[name]} + Index(blockIdx.x) * "
                                               f"{n['N']} + {n['col']}, {total}[{n['item']}]);"])), "}"]
    loaded = [f"const T {s.name} = {n['statistics_ptr']}[{_statistic(n['row'], count, k)}];" for s, k in kernel.body.loaded]
    body = [f"const bool {n['first']} = {n['row']} == Index(blockIdx.x);  // the block's first row: its sums start here",
            *loaded, *rows.row_values(kernel.body.row_values), *rows.passes(None), "// the gradients, element by element",
            *_results_loop(rows, [results[v] for v in gradients], gradients, final, stores)]
    types = [*element_type.values(), *grad_type.values()]
    return _kernel_text(rows, f"{plan.op}_backward", types, parameters, body, before=totals,
                        after=["// held rows: the block's sums, once", *sums_stores] if sums_stores else [])


def held_arrays(plan: OpPlan) -> tuple[int, int]:
    """How many [Items][Pack] arrays each kernel holds a thread where the row is held (what it
    reads, its masks, the backward's register sums): the launcher's register budget."""
    forward = len([v for i in plan.forward.inputs for v in i.values]) + len(plan.forward.masks)
    backward = len([v for i in plan.backward.inputs for v in i.values]) + len(plan.backward.incoming)
    backward += len(plan.backward.masks) + sum(not _has_rows(g.input) for g in plan.backward.gradients)
    return forward, backward


def source(plan: OpPlan) -> str:
    """The whole of <op>.cu: the forward, then the backward."""
    return forward_source(plan) + "\n" + backward_source(plan)

