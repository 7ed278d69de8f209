"""sympy printers shared by every backend. ElementwisePrinter holds the structure of
elementwise code (numbers, + - * /, small integer powers as multiplications, where,
max/min); each target supplies only its spellings: PyTorch's here (the eager reference), a
backend's kernel printer beside it (fusegen.backends.triton.printer). `strict` makes
anything without a spelling an error at build time instead of silent garbage.
"""
from __future__ import annotations

import math

import sympy
from sympy.printing.codeprinter import CodePrinter
from sympy.printing.precedence import precedence

from .functions import INF

_SMALL_POWERS = (2, 3, 4)
# Integers beyond this print as floats: a folded constant is within it (fusegen.constants),
# but a derivative may multiply one by an exponent, and Triton has no integer literal past 2**63.
_MAX_INTEGER_LITERAL = 2**53
# Factors within [-1, 1] (or a normalising x**-0.5): a product takes them first, as torch's
# (x * sigmoid(x)) * y and (x * rsqrt(var)) * w do, so that x * y cannot overflow before a
# factor that would have brought it back (inf * 0 is NaN where torch's result is finite).
_BOUNDED_FUNCTIONS = frozenset({"sigmoid", "tanh", "erf", "Heaviside", "sign", "sin", "cos"})


class ElementwisePrinter(CodePrinter):
    language = "Python"
    printmethod = "_fusegen_print"
    _default_settings = {
        **CodePrinter._default_settings,
        "strict": True,
        "precision": 17,
        "user_functions": {},
        "contract": False,
    }
    _operators = {"and": "&", "or": "|", "not": "~"}

    # A target's spellings: sympy function name → call, and the structural helpers.
    known_functions: dict[str, str] = {}
    where = sqrt = rsqrt = power = ""
    column = ""  # the element's index along the row (the language's `col`)

    def __init__(self, helpers: dict | None = None, choices: dict | None = None, row_values=frozenset(),
                 scalars=frozenset()):
        super().__init__()
        # The params, by name: one number per call. A where whose condition reads only these
        # takes one side for the whole call (`choose`, `decided_once`).
        self.scalars = frozenset(scalars)
        # A row kernel's row values (reductions and what is built from them, by name): a sum
        # subtracts them last, as torch's s - max(s) does, so that the backward's exp(mask - max
        # + x) is exp((mask + x) - max), <= 0 exactly as in the forward, not rounded past 0.
        self.row_values = frozenset(row_values)
        # A choice param's call: (param, derivative or None) → the helper function's name,
        # and param → the name that tells the helper which choice (fusegen.plan named both).
        self.helpers = helpers or {}
        self.choices = choices or {}
        # Literals printed for numbers that are not plain decimals (sqrt(2), 2/pi, 1/3):
        # literal → what it is, for a comment beside the code. Read and cleared by the caller.
        self.constants: dict[str, str] = {}

    def _format_code(self, lines):
        return lines  # expressions only: no statements to indent

    def _get_comment(self, text):
        return f"# {text}"

    def maximum(self, a: str, b: str) -> str:
        raise NotImplementedError

    def minimum(self, a: str, b: str) -> str:
        raise NotImplementedError

    def scalar(self, number: str) -> str:
        """A number as a 0-d tensor in the compute type: what a helper's argument must be."""
        raise NotImplementedError

    # -- atoms -------------------------------------------------------------

    def _print_Symbol(self, expr):
        return expr.name  # spec names are validated identifiers

    def _print_Integer(self, expr):
        return self._number(expr)

    def _print_Float(self, expr):
        # repr is the shortest text that reads back as the same double, e.g. 0.044715.
        return repr(float(expr))

    def _print_Rational(self, expr):
        return repr(expr.p / expr.q)

    def _print_NumberSymbol(self, expr):
        return repr(float(expr))

    _print_Pi = _print_Exp1 = _print_NumberSymbol

    def parenthesize(self, item, level, strict=False):
        if item.is_number and not item.is_negative:
            return self._number(item)  # a literal needs no parentheses
        return super().parenthesize(item, level, strict)

    def _print(self, expr, **kwargs):
        # A numeric subexpression (sqrt(2), 2/pi, ...) prints as one literal.
        if isinstance(expr, sympy.Expr) and expr.is_number and not expr.is_Number:
            value = self._number(abs(expr))
            return f"-{value}" if expr.is_negative else value
        return super()._print(expr, **kwargs)

    # -- arithmetic --------------------------------------------------------

    def _as_ordered_terms(self, expr, order=None):
        terms = super()._as_ordered_terms(expr, order=order)
        if not self.row_values or not isinstance(expr, sympy.Add):
            return terms
        return sorted(terms, key=self._subtracts_row_value)

    def _subtracts_row_value(self, term) -> bool:
        coefficient, rest = term.as_coeff_Mul()
        return coefficient.is_negative and rest.is_Symbol and rest.name in self.row_values

    def _print_Mul(self, expr):
        # All numeric factors (2, sqrt(2), pi**-0.5, ...) fold into one literal, printed first.
        numeric = sympy.Mul(*[f for f in expr.args if f.is_number])
        sign = ""
        if numeric.is_negative:
            numeric, sign = -numeric, "-"
        numerator, denominator = [], []
        for factor in expr.as_ordered_factors():
            if factor.is_number:
                continue
            if factor.is_Pow and factor.exp.is_Number and factor.exp < 0 and factor.exp != -sympy.Rational(1, 2):
                whole = -factor.exp
                if _is_half_integer(whole):
                    # x**-1.5 as rsqrt(x) / x: x * sqrt(x) overflows where x**-1.5 is a normal number.
                    numerator.append(sympy.Pow(factor.base, -sympy.Rational(1, 2), evaluate=False))
                    whole -= sympy.Rational(1, 2)
                denominator.append(factor.base if float(whole) == 1 else sympy.Pow(factor.base, whole))
            else:
                numerator.append(factor)
        # Row values come first too: a row kernel's normalisers (rsqrt(var + eps), hoisted)
        numerator.sort(key=lambda f: not (_is_bounded(f) or f.is_Symbol and f.name in self.row_values))  # stable
        prec = precedence(expr)
        parts = [] if numeric == 1 else [self._number(numeric)]
        parts += [self.parenthesize(f, prec) for f in numerator]
        text = " * ".join(parts) or "1.0"
        if denominator:
            under = " * ".join(self.parenthesize(f, prec) for f in denominator)
            if len(denominator) > 1 or not _is_atom_text(under):
                under = f"({under})"
            text = self.divide(text, under)
        return sign + text

    def divide(self, numerator: str, denominator: str) -> str:
        """numerator / denominator, each printed (a backend may divide by a function)."""
        return f"{numerator} / {denominator}"

    def _number(self, value) -> str:
        if value.is_Integer:
            return str(value.p) if abs(value.p) <= _MAX_INTEGER_LITERAL else repr(float(value.p))
        if value.is_Float:
            return repr(float(value))
        text = repr(float(value.evalf(30)))
        if not value.is_Rational or len(text) > 8:  # 0.5 needs no comment, 0.3333333333333333 does
            self.constants.setdefault(text, sympy.sstr(value).replace("pi", "π").replace("*", "·"))
        return text

    def _print_Pow(self, expr):
        base, exp = expr.base, expr.exp
        if exp.is_Number:
            value = float(exp)
            if value == 0.5:
                return f"{self.sqrt}({self._print(base)})"
            if value == -0.5:
                return f"{self.rsqrt}({self._print(base)})"
            if value == -1:
                return self.divide("1.0", self._wrapped(base))
            if value in _SMALL_POWERS:
                return " * ".join([self._wrapped(base)] * int(value))
            if -value in _SMALL_POWERS:
                return self.divide("1.0", f"({' * '.join([self._wrapped(base)] * int(-value))})")
            if _is_half_integer(value) and abs(value) < max(_SMALL_POWERS):
                # x**1.5 as x * sqrt(x): a correctly rounded root, not a general power;
                # x**-1.5 as rsqrt(x) / x, not 1 / (x * sqrt(x)), which overflows first.
                whole = [self._wrapped(base)] * int(abs(value))
                if value > 0:
                    return " * ".join(whole + [f"{self.sqrt}({self._print(base)})"])
                under = " * ".join(whole)
                return self.divide(f"{self.rsqrt}({self._print(base)})", under if len(whole) == 1 else f"({under})")
        return f"{self.power}({self._power_operand(base)}, {self._power_operand(exp)})"

    def _power_operand(self, expr) -> str:
        return self._print(expr)

    def _wrapped(self, expr) -> str:
        text = self._print(expr)
        return text if _is_atom_text(text) else f"({text})"

    # -- selection ---------------------------------------------------------

    def _print_Relational(self, expr):
        prec = precedence(expr)
        return f"{self.parenthesize(expr.lhs, prec)} {expr.rel_op} {self.parenthesize(expr.rhs, prec)}"

    def _print_And(self, expr):
        # & binds tighter than a comparison in Python and Triton: each operand parenthesized.
        return " & ".join(f"({self._print(a)})" for a in expr.args)

    def _print_Or(self, expr):
        return " | ".join(f"({self._print(a)})" for a in expr.args)

    def _print_negated(self, expr):
        return f"~({self._print(expr.args[0])})"

    def _print_infinity(self, expr):
        return 'float("inf")'

    def _print_column(self, expr):
        return self.column

    def _print_in_compute(self, expr):
        return self.converted(self._print(expr.args[0]))

    def converted(self, value: str) -> str:
        """An integer or bool input's value, in the compute type."""
        raise NotImplementedError

    def _print_Piecewise(self, expr):
        *pieces, (last_value, last_cond) = expr.args
        if last_cond is not sympy.true:
            raise ValueError(f"a Piecewise without an otherwise branch cannot be printed: {expr}")
        text, rest = self._print(last_value), last_value
        for value, cond in reversed(pieces):
            text = self.choose(cond, value, rest, text)
            rest = sympy.Piecewise((value, cond), (rest, True))
        return text

    def choose(self, cond, if_true, if_false, false_text: str) -> str:
        """where(cond, if_true, if_false), `if_false` already printed as `false_text` (a target
        may compute only the side taken: TritonPrinter)."""
        return f"{self.where}({self._print(cond)}, {self._print(if_true)}, {false_text})"

    def decided_once(self, cond) -> bool:
        """A condition of params (and numbers) alone: the same for every element of a call."""
        names = {symbol.name for symbol in cond.free_symbols}
        return bool(names) and names <= self.scalars

    def _print_Max(self, expr):
        return self._fold(expr.args, self.maximum)

    def _print_Min(self, expr):
        return self._fold(expr.args, self.minimum)

    def _fold(self, args, combine) -> str:
        # Numbers last, so a target may spell max(x, 0) as a clamp.
        ordered = sorted(args, key=lambda a: a.is_Number or a in (INF, -INF))
        text = self._print(ordered[0])
        for arg in ordered[1:]:
            text = combine(text, self._print(arg))
        return text

    def _print_Heaviside(self, expr):
        # d/dx max(x, 0): 1 above, 0 below, and sympy's 1/2 at the tie (as torch.maximum splits).
        x = self._print(expr.args[0])
        at_zero = expr.pargs[1] if len(expr.pargs) > 1 else sympy.Rational(1, 2)
        if at_zero == 0:  # 0 below and at 0 (relu's): NaN gives 0 either way
            return f"{self.where}({x} > 0, 1.0, 0.0)"
        return f"{self.where}({x} > 0, 1.0, {self.where}({x} < 0, 0.0, {self._print(at_zero)}))"

    def _print_saturated(self, expr):
        x, bound = expr.args
        return self.maximum(self.minimum(self._print(x), self._print(bound)), self._print(-bound))

    def _print_clamp(self, expr):
        # As torch.clamp: the lower bound first, so that hi wins where lo > hi.
        x, lo, hi = (self._print(a) for a in expr.args)
        return self.minimum(self.maximum(x, lo), hi)

    def _print_sign(self, expr):
        x = self._print(expr.args[0])
        return f"{self.where}({x} > 0, 1.0, {self.where}({x} < 0, -1.0, 0.0))"

    def _print_Function(self, expr):
        param = getattr(expr.func, "choice_param", None)
        if param is not None:  # a number argument (act(1)) is made a tensor: helpers compute on tensors
            args = ", ".join(self.scalar(self._print(a)) if a.is_number else self._print(a) for a in expr.args)
            return f"{self.helpers[(param, expr.func.derivative)]}({args}, {self.choices[param]})"
        return super()._print_Function(expr)


def _is_bounded(factor) -> bool:
    if factor.is_Pow:
        return factor.exp == -sympy.Rational(1, 2)
    return isinstance(factor, sympy.Function) and factor.func.__name__ in _BOUNDED_FUNCTIONS


def _is_half_integer(value) -> bool:
    """1.5, 2.5, -1.5, ... (not 0.5 or -0.5: sqrt and rsqrt themselves)."""
    value = float(value)
    return (2 * value) % 2 == 1 and abs(value) > 1


def _is_atom_text(text: str) -> bool:
    """A name, a number or a call: safe as an operand without parentheses."""
    if text.replace("_", "").replace(".", "").isalnum():
        return True
    if text.endswith(")") and "(" in text:
        head = text[: text.index("(")]  # "" for a parenthesized group, else a call's name
        depth = 0
        for i, ch in enumerate(text[len(head):]):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i != len(text) - len(head) - 1:
                return False
        return head == "" or head.replace(".", "").replace("_", "").isalnum()
    return False


class TorchPrinter(ElementwisePrinter):
    """PyTorch eager: tensors in the compute dtype; Python floats where sympy has numbers."""

    known_functions = {
        "exp": "torch.exp",
        "log": "torch.log",
        "tanh": "torch.tanh",
        "erf": "torch.erf",
        "Abs": "torch.abs",
        "sigmoid": "torch.sigmoid",
        "relu": "torch.relu",
        "round_half_even": "torch.round",
        "floor": "torch.floor",
        "log1p": "torch.log1p",
        "expm1": "torch.expm1",
        "sin": "torch.sin",
        "cos": "torch.cos",
    }
    where, sqrt, rsqrt, power = "torch.where", "torch.sqrt", "torch.rsqrt", "torch.pow"
    column = "torch.arange(problem.n, dtype=problem.compute_dtype, device=problem.device)"

    def converted(self, value):
        return f"{value}.to(problem.compute_dtype)"

    def choose(self, cond, if_true, if_false, false_text):
        # Decided by params (0-d tensors here): torch.where, differentiated along the side taken
        # only, as the kernels compute only that side (runtime.reference says why).
        if self.decided_once(cond):
            return f"runtime.decided_where({self._print(cond)}, {self._print(if_true)}, {false_text})"
        return super().choose(cond, if_true, if_false, false_text)

    def maximum(self, a, b):
        return f"torch.clamp_min({a}, {b})" if _is_number_text(b) else f"torch.maximum({a}, {b})"

    def _print_clamp(self, expr):
        # torch's own, whose derivative is 1 at the bounds (torch.maximum's is 1/2 at a tie).
        # It takes both bounds as numbers or both as tensors.
        x, lo, hi = (self._print(a) for a in expr.args)
        if not (_is_number_text(lo) and _is_number_text(hi)):
            lo, hi = (self.scalar(b) if _is_number_text(b) else b for b in (lo, hi))
        return f"torch.clamp({x}, {lo}, {hi})"

    def _print_sign(self, expr):
        # torch's own: the same values (0 for NaN), and a reference autograd can differentiate.
        return f"torch.sign({self._print(expr.args[0])})"

    def minimum(self, a, b):
        return f"torch.clamp_max({a}, {b})" if _is_number_text(b) else f"torch.minimum({a}, {b})"

    def scalar(self, number):
        return f"torch.tensor({number}, dtype=problem.compute_dtype, device=problem.device)"


def _is_number_text(text: str) -> bool:
    if text.lstrip("-") == 'float("inf")':
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


class EagerPrinter:
    """The spec's IR as a PyTorch user writes it: torch.nn.functional where torch has the op,
    torch's own dropout. Prints the IR rather than sympy on purpose: the point is the user's
    spelling (F.gelu, F.dropout), not fusegen's definitions."""

    def __init__(self, names: dict[str, str], chunks: dict[str, str], helpers: dict[str, str],
                 lets: dict[int, str] | None = None, column: str = "", hidden=None):
        self.names = names  # spec name → the name the generated function uses
        self.chunks = chunks  # chunked input → the name of its tuple of chunks
        self.helpers = helpers  # choice param → its eager helper
        self.lets = lets or {}  # id(an intermediate's tree) → the local that holds it
        self.column = column  # `col`: torch.arange over the last dim of an input that has it
        self.hidden = hidden  # the matmul's hidden layer's function (ir.OpIR.hidden), if any
        self._defining = None

    def doprint(self, expr, defining: bool = False) -> str:
        """An expression; an intermediate's tree by its local. `defining`: `expr` is the
        intermediate's own definition, printed in full (an output that *is* an intermediate
        is its local: printing it again would draw a second dropout mask)."""
        self._defining = id(expr) if defining else None
        return self._print(expr)

    def _print(self, e) -> str:
        from . import ir  # printers otherwise depend on sympy only

        if id(e) in self.lets and id(e) != self._defining:
            return self.lets[id(e)]
        if isinstance(e, ir.Const):
            return 'float("inf")' if e.value == math.inf else repr(e.value)
        if isinstance(e, (ir.InputRef, ir.ParamRef)):
            return self.names[e.name]
        if isinstance(e, ir.ChunkRef):
            return f"{self.chunks[e.name]}[{e.index}]"
        if isinstance(e, ir.Col):
            return self.column
        if isinstance(e, ir.MatMul):  # an atom: F.linear, or the parenthesized product
            a, b = self._print(self.hidden) if e.hidden else self.names[e.a], self.names[e.b]
            return f"F.linear({a}, {b})" if e.transposed else f"({a} @ {b})"
        if isinstance(e, ir.LowRank):  # an atom too: F.linear(F.linear(x, lora_a), lora_b)
            inner = self._linear(self.names[e.a], self.names[e.down], e.down_transposed)
            return self._linear(inner, self.names[e.up], e.up_transposed)
        if isinstance(e, ir.ProductChunk):  # the product of a with b's chunk: F.linear(x, w.chunk(2)[0])
            a, b, m = self.names[e.matmul.a], self.names[e.matmul.b], e.matmul
            part = f"{b}.chunk({e.count}, dim={0 if m.transposed else -1})[{e.index}]"
            return f"F.linear({a}, {part})" if m.transposed else f"({a} @ {part})"
        if isinstance(e, ir.Unary):
            return f"-{self._operand(e.operand)}"
        if isinstance(e, ir.Binary):
            return f"{self._operand(e.left)} {e.op} {self._operand(e.right)}"
        if isinstance(e, ir.Compare):  # where's condition: a tensor, even between numbers
            numbers = _is_python_number(e.left) and _is_python_number(e.right)
            left = self._tensor(e.left) if numbers else self._operand(e.left)
            return f"{left} {e.op} {self._operand(e.right)}"
        if isinstance(e, ir.Logic):
            if e.op == "~":
                return f"~({self._print(e.args[0])})"
            return f" {e.op} ".join(f"({self._print(a)})" for a in e.args)
        if isinstance(e, ir.Where):
            if _is_python_scalar(e.cond):  # of params and numbers only: a Python bool, one branch taken
                return f"({self._print(e.if_true)} if {self._condition(e.cond)} else {self._print(e.if_false)})"
            return f"torch.where({self._print(e.cond)}, {self._print(e.if_true)}, {self._print(e.if_false)})"
        if isinstance(e, ir.Call):
            from .functions import FUNCTIONS

            idiom = FUNCTIONS[e.func].torch_idiom
            return idiom.format(*(self._argument(a, idiom, i) for i, a in enumerate(e.args)))
        if isinstance(e, ir.ChoiceCall):
            args = ", ".join(self._tensor(a) if _is_python_number(a) else self._print(a) for a in e.args)
            return f"{self.helpers[e.param]}({args}, {self.names[e.param]})"
        if isinstance(e, ir.Dropout):
            return f"F.dropout({self._print(e.value)}, {self.names[e.p]}, training=training)"
        if isinstance(e, ir.Reduce):
            method = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}[e.op]
            return f"{self._operand(e.value)}.{method}(-1, keepdim=True)"
        raise TypeError(f"unknown IR node {type(e).__name__}")

    def _argument(self, e, idiom: str, index: int) -> str:
        """An argument bare where the idiom already sets it off as a call argument; a number
        in the first place (the input of F.relu, torch.exp, ...) made a tensor."""
        if index == 0 and _is_python_number(e) and idiom != "{0}":
            return self._tensor(e)
        slot = "{%d}" % index
        enclosed = all(
            idiom[max(0, at - 1)] in "(, " and idiom[at + len(slot):at + len(slot) + 1] in "),"
            for at in _find_all(idiom, slot)
        )
        return self._print(e) if enclosed else self._operand(e)

    @staticmethod
    def _linear(a: str, b: str, transposed: bool) -> str:
        return f"F.linear({a}, {b})" if transposed else f"({a} @ {b})"

    def _operand(self, e) -> str:
        from . import ir

        text = self._print(e)
        atom = id(e) in self.lets and id(e) != self._defining  # an intermediate, printed as its local
        return f"({text})" if isinstance(e, (ir.Binary, ir.Compare, ir.Unary)) and not atom else text

    def _condition(self, e) -> str:
        """A condition of params and numbers, in Python: `and`, `or`, `not` for & | ~."""
        from . import ir

        if isinstance(e, ir.Logic):
            if e.op == "~":
                return f"not ({self._condition(e.args[0])})"
            return f" {'and' if e.op == '&' else 'or'} ".join(f"({self._condition(a)})" for a in e.args)
        return f"{self._operand(e.left)} {e.op} {self._operand(e.right)}"

    def _tensor(self, e) -> str:
        from . import ir

        value = f"float({self._print(e)})" if not isinstance(e, ir.Const) or e.value == math.inf else repr(float(e.value))
        return f"torch.tensor({value})"


def _is_python_number(e) -> bool:
    """An IR tree the eager code computes as a Python number (1, -2, 2 ** 0.5): torch's
    functions take tensors."""
    from . import ir

    if isinstance(e, ir.Const):
        return True
    if isinstance(e, ir.Unary):
        return _is_python_number(e.operand)
    if isinstance(e, ir.Binary):
        return _is_python_number(e.left) and _is_python_number(e.right)
    return False


def _is_python_scalar(e) -> bool:
    """An IR tree of params and numbers only: a Python value in the eager code."""
    from . import ir

    if isinstance(e, (ir.Const, ir.ParamRef)):
        return True
    if isinstance(e, ir.Unary):
        return _is_python_scalar(e.operand)
    if isinstance(e, (ir.Binary, ir.Compare)):
        return _is_python_scalar(e.left) and _is_python_scalar(e.right)
    if isinstance(e, ir.Logic):
        return all(_is_python_scalar(a) for a in e.args)
    return False


def _find_all(text: str, part: str) -> list[int]:
    found, at = [], text.find(part)
    while at != -1:
        found.append(at)
        at = text.find(part, at + 1)
    return found
