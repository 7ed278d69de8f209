"""Bad specs: one line `specs/x.yaml:LINE: message` on stderr, exit 2, the output folder untouched.

Each class of mistake is one short spec, with its message pinned in full: the line is that
of the offending key or value. Every case runs the real `fusegen build` on a folder holding
a good spec and the bad one, into an output folder that already holds generated files.
"""
import random
import shutil
from pathlib import Path

import pytest

from fusegen import cli
from fusegen.errors import SpecError
from fusegen.ir import build_ir
from fusegen.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent

# Sorted before x.yaml: it builds fine before the bad spec fails, and still nothing is written.
GOOD = "name: good\ndoc: a good spec\ninputs:\n  x: [..., N]\noutputs:\n  y: x + 1\n"

H = "name: op\ndoc: d\n"  # lines 1 and 2 of most cases

CASES = [
    ("yaml_unclosed_flow", H + "inputs:\n  x: [..., N\noutputs:\n  y: x\n",
     "specs/x.yaml:5: YAML syntax error: expected ',' or ']', but got ':'"),
    ("yaml_bad_indent", H + "inputs:\n  x: [N]\noutputs:\n  y: x\n z: x\n",
     "specs/x.yaml:7: YAML syntax error: expected <block end>, but found '<block mapping start>'"),
    ("yaml_tab", H + "inputs:\n\tx: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:4: YAML syntax error: found character '\\t' that cannot start any token"),
    ("yaml_two_documents", H + "inputs: {x: [N]}\noutputs: {y: x}\n---\nname: other\n",
     "specs/x.yaml:5: YAML syntax error: expected a single document in the stream, but found another document"),
    ("yaml_python_tag", H + "inputs: {x: [N]}\noutputs:\n  y: !!python/object/apply:os.system [echo hi]\n",
     "specs/x.yaml:5: YAML tag '!!python/object/apply:os.system' is not supported in a spec (quote a value to make it a string)"),
    ("yaml_custom_tag", H + "inputs: {x: !shape [N]}\noutputs: {y: x}\n",
     "specs/x.yaml:3: YAML tag '!shape' is not supported in a spec (quote a value to make it a string)"),
    ("yaml_anchor", H + "inputs:\n  x: &shape [..., N]\n  r: *shape\noutputs:\n  y: x + r\n",
     "specs/x.yaml:4: YAML anchor '&shape' is not supported in a spec"),
    ("yaml_alias", H + "inputs:\n  x: [..., N]\noutputs:\n  y: x\n  z: *y\n",
     "specs/x.yaml:7: YAML alias '*y' is not supported in a spec: write the value out"),
    ("yaml_merge_key", H + "inputs:\n  x: [N]\noutputs:\n  <<: {y: x}\n",
     "specs/x.yaml:6: YAML merge keys '<<' are not supported in a spec"),
    ("yaml_non_string_key", H + "inputs:\n  ? [x, y]\n  : [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:4: mapping keys must be plain names, not lists or mappings"),
    ("yaml_control_char", H + "inputs: {x: [N]}\noutputs:\n  y: x\x07\n",
     "specs/x.yaml:5: YAML cannot hold the character '\\x07'"),
    ("yaml_too_deep", H + "inputs: {x: " + "[" * 40 + "]" * 40 + "}\noutputs: {y: x}\n",
     "specs/x.yaml:3: YAML is nested more than 16 levels deep"),
    ("not_utf8", b"name: op\ndoc: d\ninputs: {x: [N]}\noutputs:\n  y: x * \xb5\n",
     "specs/x.yaml:5: spec is not UTF-8 (invalid start byte at byte 51)"),
    ("empty_file", "",
     "specs/x.yaml:1: a spec must be a mapping with keys name, doc, inputs, outputs; got nothing"),
    ("comments_only", "# nothing yet\n",
     "specs/x.yaml:1: a spec must be a mapping with keys name, doc, inputs, outputs; got nothing"),
    ("top_level_list", "- name: op\n- doc: d\n",
     "specs/x.yaml:1: a spec must be a mapping with keys name, doc, inputs, outputs; got a list"),
    ("top_level_scalar", "bias_gelu\n",
     "specs/x.yaml:1: a spec must be a mapping with keys name, doc, inputs, outputs; got 'bias_gelu'"),
    ("missing_key", H + "inputs:\n  x: [N]\n",
     "specs/x.yaml:1: missing required key 'outputs' in the spec"),
    ("unknown_key", H + "inputs:\n  x: [N]\noutput:\n  y: x\n",
     "specs/x.yaml:5: unknown key 'output' in the spec (known: name, doc, inputs, params, let, outputs, backend)"),
    ("unknown_param_key", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1.0, step: 0.1}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: unknown key 'step' in param 's' (known: type, default, min, max, gt, lt)"),
    ("duplicate_yaml_key", H + "inputs:\n  x: [N]\noutputs:\n  y: x\nname: op2\n",
     "specs/x.yaml:7: duplicate key 'name' (first at line 1)"),
    ("duplicate_yaml_key_nested", H + "inputs:\n  x: [N]\n  x: [M]\noutputs:\n  y: x\n",
     "specs/x.yaml:5: duplicate key 'x' (first at line 4)"),
    ("inputs_as_list", H + "inputs:\n  - x\n  - bias\noutputs:\n  y: x\n",
     "specs/x.yaml:4: 'inputs' must be a mapping, got a list"),
    ("outputs_as_string", H + "inputs:\n  x: [N]\noutputs: x + 1\n",
     "specs/x.yaml:5: 'outputs' must be a mapping, got 'x + 1'"),
    ("params_as_list", H + "inputs:\n  x: [N]\nparams: [p]\noutputs:\n  y: x\n",
     "specs/x.yaml:5: 'params' must be a mapping, got a list"),
    ("param_not_mapping", H + "inputs:\n  x: [N]\nparams:\n  s: 0.5\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's' must be a mapping, got 0.5"),
    ("shape_not_list", H + "inputs:\n  x: N\noutputs:\n  y: x\n",
     "specs/x.yaml:4: the shape of input 'x' must be a list, got 'N'"),
    ("bad_dim", H + "inputs:\n  x: [..., 2]\noutputs:\n  y: x\n",
     "specs/x.yaml:4: input 'x': dim '2' must be '...', a dim name such as N, 1, or (last) 2N"),
    ("chunked_dim_not_last", H + "inputs:\n  x: [M, 2N, K]\noutputs:\n  y: x\n",
     "specs/x.yaml:4: input 'x': a chunked dim such as 2N may only be the last dim, or the first of two ([2N, K], "
     "a matmul's weight)"),
    ("chunked_first_dim_read_elementwise", H + "inputs:\n  x: [2N, M]\noutputs:\n  y: x\n",
     "specs/x.yaml:6: 'x' holds its chunks along its first dim: only a matmul reads it, as chunk(x @ T(x), 0)"),
    ("chunked_input_used_whole", H + "inputs:\n  x: [..., 2N]\noutputs:\n  y: x\n",
     "specs/x.yaml:6: '{x}' holds 2 chunks along its last dim: use chunk(x, 0) ... chunk(x, 1)".replace("{x}", "x")),
    ("chunk_index_out_of_range", H + "inputs:\n  x: [..., 2N]\noutputs:\n  y: chunk(x, 2)\n",
     "specs/x.yaml:6: chunk's second argument must be a whole number from 0 to 1"),
    ("chunk_of_unchunked_input", H + "inputs:\n  x: [..., N]\noutputs:\n  y: chunk(x, 0)\n",
     "specs/x.yaml:6: chunk's first argument must be an input declared with a chunked last dim, as x: [..., 2N], "
     "or a matmul whose right operand holds chunks"),
    ("ellipsis_not_first", H + "inputs:\n  x: [N, ...]\noutputs:\n  y: x\n",
     "specs/x.yaml:4: input 'x': '...' may only be the first dim"),
    ("no_inputs", H + "inputs: {}\noutputs:\n  y: 1\n",
     "specs/x.yaml:3: 'inputs' must name at least one input"),
    ("no_outputs", H + "inputs:\n  x: [N]\noutputs: {}\n",
     "specs/x.yaml:5: 'outputs' must name at least one expression"),
    ("cannot_broadcast", H + "inputs:\n  x: [..., N]\n  bias: [M]\noutputs:\n  y: x + bias\n",
     "specs/x.yaml:5: inputs 'x' [..., N] and 'bias' [M] cannot broadcast: dim -1 is N in one and M in the other"),
    ("cannot_broadcast_inner", H + "inputs:\n  x: [..., M, N]\n  w: [K, N]\noutputs:\n  y: x * w\n",
     "specs/x.yaml:5: inputs 'x' [..., M, N] and 'w' [K, N] cannot broadcast: dim -2 is M in one and K in the other"),
    ("op_name_invalid", "name: bias-gelu\ndoc: d\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:1: op name 'bias-gelu' is not a Python identifier"),
    ("op_name_keyword", "name: lambda\ndoc: d\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:1: op name 'lambda' is a Python keyword"),
    ("op_name_empty", "name:\ndoc: d\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:1: op name is empty"),
    ("op_name_hides_an_import", "name: torch\ndoc: d\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:1: op name 'torch' would hide the module's import of torch"),
    ("op_name_hides_a_builtin", "name: range\ndoc: d\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:1: op name 'range' would hide Python's builtin range"),
    ("op_name_is_a_module_function", "name: reference\ndoc: d\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:1: op name 'reference' is the name of the generated module's function reference()"),
    ("op_name_taken", "name: good\ndoc: d\ninputs:\n  x: [N]\noutputs:\n  y: x * 2\n",
     "specs/x.yaml:1: op name 'good' is already defined by specs/a_good.yaml"),
    ("name_not_identifier", H + "inputs:\n  x: [N]\n  2x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:5: input name '2x' is not a Python identifier"),
    ("name_non_ascii", H + "inputs:\n  x: [N]\noutputs:\n  ÿ: x\n",
     "specs/x.yaml:6: output name 'ÿ' must be ASCII"),
    ("name_keyword", H + "inputs:\n  x: [N]\nparams:\n  lambda: {type: float, default: 1.0}\noutputs:\n  y: x\n",
     "specs/x.yaml:6: param name 'lambda' is a Python keyword"),
    ("name_in_the_signature", H + "inputs:\n  x: [N]\n  seed: [N]\noutputs:\n  y: x + seed\n",
     "specs/x.yaml:5: input name 'seed' is an argument of the generated op (dropout's seed=)"),
    ("name_out", H + "inputs:\n  x: [N]\nparams:\n  out: {type: float, default: 1.0}\noutputs:\n  y: x * out\n",
     "specs/x.yaml:6: param name 'out' is an argument of the generated op (out=)"),
    ("name_inplace_backward", H + "inputs:\n  x: [N]\n  inplace_backward: [N]\noutputs:\n  y: x + inplace_backward\n",
     "specs/x.yaml:5: input name 'inplace_backward' is an argument of the generated op (inplace_backward=)"),
    ("name_self", H + "inputs:\n  x: [N]\n  self: [N]\noutputs:\n  y: x + self\n",
     "specs/x.yaml:5: input name 'self' is the first argument of the op's torch.nn.Module methods"),
    ("name_underscore", H + "inputs:\n  x: [N]\nlet:\n  _h: x\noutputs:\n  y: _h\n",
     "specs/x.yaml:6: intermediate name '_h' must not start with '_' (reserved for generated code)"),
    ("name_shadows_function", H + "inputs:\n  exp: [N]\noutputs:\n  y: exp\n",
     "specs/x.yaml:4: input name 'exp' is the name of the function 'exp' of the expression language"),
    ("duplicate_name", H + "inputs:\n  x: [N]\nparams:\n  x: {type: float, default: 1.0}\noutputs:\n  y: x\n",
     "specs/x.yaml:6: duplicate name 'x' (already an input at line 4)"),
    ("duplicate_name_let_output", H + "inputs:\n  x: [N]\nlet:\n  y: x + 1\noutputs:\n  y: y\n",
     "specs/x.yaml:8: duplicate name 'y' (already an intermediate at line 6)"),
    ("unknown_name", H + "inputs:\n  x: [N]\nparams:\n  alpha: {type: float, default: 1.0}\noutputs:\n  y: x * alpha + beta\n",
     "specs/x.yaml:8: unknown name 'beta' (known: alpha, x)"),
    ("unknown_function", H + "inputs:\n  x: [..., N]\n  bias: [N]\noutputs:\n  y: gelux(x + bias)\n",
     "specs/x.yaml:7: unknown function 'gelux' (known: T, abs, chunk, clamp, cos, dropout, erf, exp, expm1, floor, gelu, gelu_tanh, identity, leaky_relu, log, log1p, max, mean, min, quick_gelu, relu, round, rsqrt, sigmoid, sign, silu, sin, softplus, sqrt, squared_relu, sum, take, tanh, where)"),
    ("unknown_choice", H + "inputs:\n  x: [N]\nparams:\n  act: {choices: [relu, gelux], default: relu}\noutputs:\n  y: act(x)\n",
     "specs/x.yaml:6: param 'act': unknown function 'gelux' in choices (known: abs, clamp, cos, erf, exp, expm1, floor, gelu, gelu_tanh, identity, leaky_relu, log, log1p, max, min, quick_gelu, relu, round, rsqrt, sigmoid, sign, silu, sin, softplus, sqrt, squared_relu, tanh)"),
    ("choice_not_a_name", H + "inputs:\n  x: [N]\nparams:\n  act: {choices: [relu, [gelu]], default: relu}\noutputs:\n  y: act(x)\n",
     "specs/x.yaml:6: param 'act': choices must be function names, got a list"),
    ("choice_default_not_a_choice", H + "inputs:\n  x: [N]\nparams:\n  act:\n    choices: [relu, gelu]\n    default: silu\noutputs:\n  y: act(x)\n",
     "specs/x.yaml:8: param 'act': default 'silu' is not one of its choices"),
    ("choice_arities_differ", H + "inputs:\n  x: [N]\nparams:\n  act: {choices: [relu, max], default: relu}\noutputs:\n  y: act(x)\n",
     "specs/x.yaml:6: param 'act': all choices must take the same number of arguments"),
    ("choice_empty", H + "inputs:\n  x: [N]\nparams:\n  act: {choices: [], default: relu}\noutputs:\n  y: act(x)\n",
     "specs/x.yaml:6: param 'act': 'choices' must not be empty"),
    ("wrong_arity", H + "inputs:\n  x: [N]\noutputs:\n  y: tanh(x, x)\n",
     "specs/x.yaml:6: tanh() takes 1 argument, got 2"),
    ("param_min_and_gt", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1.0, min: 0.0, gt: 0.0}\noutputs:\n  y: x / s\n",
     "specs/x.yaml:6: param 's': give 'min' (inclusive) or 'gt' (exclusive), not both"),
    ("param_default_at_gt", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 0.0, gt: 0.0}\noutputs:\n  y: x / s\n",
     "specs/x.yaml:6: param 's': default 0.0 is not greater than gt 0.0"),
    ("param_default_at_lt", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1.0, lt: 1.0}\noutputs:\n  y: x / s\n",
     "specs/x.yaml:6: param 's': default 1.0 is not less than lt 1.0"),
    ("param_gt_not_below_max", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1.0, gt: 1.0, max: 1.0}\noutputs:\n  y: x / s\n",
     "specs/x.yaml:6: param 's': gt 1.0 is not less than max 1.0"),
    ("param_gt_not_a_number", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1.0, gt: zero}\noutputs:\n  y: x / s\n",
     "specs/x.yaml:6: param 's': 'gt' must be a number, got 'zero'"),
    ("inf_in_arithmetic", H + "inputs:\n  x: [N]\noutputs:\n  y: x + (inf - inf)\n",
     "specs/x.yaml:6: 'inf - inf': inf takes no arithmetic; use it in comparisons, where's branches, max, min and clamp"),
    ("input_named_inf", H + "inputs:\n  inf: [N]\noutputs:\n  y: inf\n",
     "specs/x.yaml:4: input name 'inf' is a literal of the expression language"),
    ("logic_unparenthesized", H + "inputs:\n  x: [N]\noutputs:\n  y: where(x > 0 & x < 1, x, 0.0)\n",
     "specs/x.yaml:6: only single comparisons (<, <=, >, >=, ==, !=) are supported (& and | bind tighter than comparisons: parenthesize each, as in (x > 0) & (x < 1))"),
    ("logic_python_and", H + "inputs:\n  x: [N]\noutputs:\n  y: where(x > 0 and x < 1, x, 0.0)\n",
     "specs/x.yaml:6: unsupported operator in x > 0 and x < 1: combine conditions with & | ~, each comparison in parentheses, as in (x > 0) & (x < 1)"),
    ("logic_of_a_number", H + "inputs:\n  x: [N]\noutputs:\n  y: where((x > 0) & x, x, 0.0)\n",
     "specs/x.yaml:6: & | ~ combine conditions, and x is not one: write a comparison, as in (x > 0) & (y < 1)"),
    ("logic_outside_where", H + "inputs:\n  x: [N]\noutputs:\n  y: x * ((x > 0) | (x < -1))\n",
     "specs/x.yaml:6: a comparison can only be the first argument of where(...)"),
    ("invert_of_a_number", H + "inputs:\n  x: [N]\noutputs:\n  y: ~x\n",
     "specs/x.yaml:6: & | ~ combine conditions, and x is not one: write a comparison, as in (x > 0) & (y < 1)"),
    ("input_named_col", H + "inputs:\n  col: [..., N]\noutputs:\n  y: col\n",
     "specs/x.yaml:4: input name 'col' is a built-in name of the expression language"),
    ("col_without_a_last_dim", H + "inputs:\n  x: [..., 1]\noutputs:\n  y: x * col\n",
     "specs/x.yaml:6: 'col' is the element's index along the last dim, and no input of this op has one"),
    ("sum_of_col", H + "inputs:\n  x: [..., N]\noutputs:\n  y: x - sum(col * 1.0)\n",
     "specs/x.yaml:6: sum(col * 1.0) reduces an expression of [N]-shaped inputs only: the same value for every row; reduce an expression of a full-shape input such as [..., N]"),
    ("wrong_arity_clamp", H + "inputs:\n  x: [N]\noutputs:\n  y: clamp(x, 0.0)\n",
     "specs/x.yaml:6: clamp() takes 3 arguments, got 2"),
    ("log1p_of_minus_one", H + "inputs:\n  x: [N]\noutputs:\n  y: x * log1p(-1.0)\n",
     "specs/x.yaml:6: output 'y': constant subexpression `log1p(-1.0)` is not a finite real number (it is infinite)"),
    ("wrong_arity_choice", H + "inputs:\n  x: [N]\nparams:\n  act: {choices: [relu, gelu], default: relu}\noutputs:\n  y: act(x, 1)\n",
     "specs/x.yaml:8: act() takes 1 argument, got 2"),
    ("unparsable", H + "inputs:\n  x: [N]\noutputs:\n  y: x +* 2\n",
     "specs/x.yaml:6: cannot parse 'x +* 2': invalid syntax"),
    ("unparsable_unclosed", H + "inputs:\n  x: [N]\noutputs:\n  y: exp(x\n",
     "specs/x.yaml:6: cannot parse 'exp(x': '(' was never closed"),
    ("comparison_outside_where", H + "inputs:\n  x: [N]\noutputs:\n  y: x > 0\n",
     "specs/x.yaml:6: a comparison can only be the first argument of where(...)"),
    ("comparison_in_arithmetic", H + "inputs:\n  x: [N]\noutputs:\n  y: (x > 0) * x\n",
     "specs/x.yaml:6: a comparison can only be the first argument of where(...)"),
    ("where_without_comparison", H + "inputs:\n  x: [N]\noutputs:\n  y: where(x, x, 0)\n",
     "specs/x.yaml:6: where's first argument must be a comparison, as in where(x > 0, x, 0)"),
    ("choice_as_value", H + "inputs:\n  x: [N]\nparams:\n  act: {choices: [relu, gelu], default: relu}\noutputs:\n  y: x * act\n",
     "specs/x.yaml:8: 'act' is a choice of function; call it, as in act(x)"),
    ("dropout_p_int", H + "inputs:\n  x: [N]\nparams:\n  k: {type: int, default: 1, min: 0, max: 1}\noutputs:\n  y: dropout(x, k)\n",
     "specs/x.yaml:8: dropout's second argument must be the name of a float param, as in dropout(x, p)"),
    ("dropout_p_constant", H + "inputs:\n  x: [N]\noutputs:\n  y: dropout(x, 0.1)\n",
     "specs/x.yaml:6: dropout's second argument must be the name of a float param, as in dropout(x, p)"),
    ("dropout_p_unbounded", H + "inputs:\n  x: [N]\nparams:\n  p: {type: float, default: 0.1}\noutputs:\n  y: dropout(x, p)\n",
     "specs/x.yaml:6: param 'p' is dropout's p, so its range must lie in [0, 1]: give it min: 0.0 and max: 1.0"),
    ("unused_input", H + "inputs:\n  x: [..., N]\n  bias: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:5: input 'bias' is never used"),
    ("unused_param", H + "inputs:\n  x: [N]\nparams:\n  alpha: {type: float, default: 1.0}\noutputs:\n  y: x\n",
     "specs/x.yaml:6: param 'alpha' is never used"),
    ("unused_let", H + "inputs:\n  x: [N]\nlet:\n  h: x * 2\noutputs:\n  y: x\n",
     "specs/x.yaml:6: intermediate 'h' is never used"),
    ("expression_too_deep", H + "inputs:\n  x: [N]\noutputs:\n  y: " + "exp(" * 70 + "x" + ")" * 70 + "\n",
     "specs/x.yaml:6: expression is nested more than 64 levels deep, counting the intermediates it uses"),
    ("expression_too_large", H + "inputs:\n  x: [N]\nlet:\n  h0: x\n"
     + "".join(f'  h{i}: h{i - 1} + h{i - 1}\n' for i in range(1, 12)) + "outputs:\n  y: h11\n",
     "specs/x.yaml:15: expression has more than 1000 terms, counting each use of an intermediate in full"),
    ("expression_too_long", H + "inputs:\n  x: [N]\noutputs:\n  y: " + "x + " * 600 + "x\n",
     "specs/x.yaml:6: expression for 'y' is longer than 2000 characters"),
    # (A list is a concatenated output and a mapping the long form now.)
    ("expression_not_string", H + "inputs:\n  x: [N]\noutputs:\n  y: [x, {a: x}]\n",
     "specs/x.yaml:6: output 'y': each part must be an expression (a string), got a mapping"),
    ("output_unknown_key", H + "inputs:\n  x: [N]\noutputs:\n  y: {a: x}\n",
     "specs/x.yaml:6: unknown key 'a' in output 'y' (known: expr, dtype, differentiable)"),
    ("concatenated_one_part", H + "inputs:\n  x: [N]\noutputs:\n  y: [x]\n",
     "specs/x.yaml:6: output 'y': a concatenated output has 2 to 99 parts, got 1"),
    ("expression_empty", H + "inputs:\n  x: [N]\noutputs:\n  y:\n",
     "specs/x.yaml:6: output 'y' has an empty expression"),
    ("expression_non_ascii", H + "inputs:\n  x: [N]\noutputs:\n  y: x * π\n",
     "specs/x.yaml:6: expression for 'y' contains the character 'π': expressions are plain ASCII"),
    ("expression_comment", H + "inputs:\n  x: [N]\noutputs:\n  y: |\n    x  # the input\n    + 1\n",
     "specs/x.yaml:6: expression for 'y' contains '#': comments are not allowed inside an expression"),
    ("expression_evaluates_nothing", H + 'inputs:\n  x: [N]\noutputs:\n  y: "__import__(\'os\').system(\'touch pwned\')"\n',
     "specs/x.yaml:6: unsupported call: __import__('os').system('touch pwned') (call a function by its name)"),
    ("expression_attribute", H + "inputs:\n  x: [N]\noutputs:\n  y: x.exp()\n",
     "specs/x.yaml:6: unsupported call: x.exp() (call a function by its name)"),
    # Constant subexpressions fold to one literal: a finite real number within the literal bounds.
    ("constant_infinite", H + "inputs:\n  x: [N]\noutputs:\n  y: x * 0 ** -1\n",
     "specs/x.yaml:6: output 'y': constant subexpression `0 ** -1` is not a finite real number (it is infinite)"),
    ("constant_division_by_zero", H + "inputs:\n  x: [N]\noutputs:\n  y: x / 0\n",
     "specs/x.yaml:6: output 'y': `x / 0` simplifies to a product whose constant factor is not a finite real number "
     "(it is infinite)"),
    ("constant_complex", H + "inputs:\n  x: [N]\noutputs:\n  y: x + sqrt(-1)\n",
     "specs/x.yaml:6: output 'y': constant subexpression `sqrt(-1)` is not a finite real number (it is complex)"),
    ("constant_in_intermediate", H + "inputs:\n  x: [N]\nlet:\n  h: max(x, log(-2))\noutputs:\n  y: h\n",
     "specs/x.yaml:6: intermediate 'h': constant subexpression `log(-2)` is not a finite real number (it is complex)"),
    ("constant_by_cancelling", H + "inputs:\n  x: [N]\nlet:\n  h: x - x\noutputs:\n  y: log(h) + x\n",
     "specs/x.yaml:8: output 'y': constant subexpression `log(h)` is not a finite real number (it is infinite)"),
    ("constant_overflows", H + "inputs:\n  x: [N]\noutputs:\n  y: x * 10.0 ** 400\n",
     "specs/x.yaml:6: output 'y': constant subexpression `10.0 ** 400` is out of range (at most 1e30 in magnitude)"),
    ("constant_integer_too_large", H + "inputs:\n  x: [N]\noutputs:\n  y: x * 9 ** 9 ** 9\n",
     "specs/x.yaml:6: output 'y': constant subexpression `9 ** 9 ** 9` is out of range (at most 2**53 in magnitude)"),
    ("constant_factor_too_large", H + "inputs:\n  x: [N]\noutputs:\n  y: x * 10**10 * 10**10\n",
     "specs/x.yaml:6: output 'y': `x * 10 ** 10 * 10 ** 10` simplifies to a product whose constant factor is out of "
     "range (at most 2**53 in magnitude)"),
    ("constant_choice", H + "inputs:\n  x: [N]\nparams:\n  act: {choices: [relu, log], default: relu}\noutputs:\n  y: x + act(0)\n",
     "specs/x.yaml:8: output 'y': constant subexpression `act(0)` with act = log is not a finite real number (it is infinite)"),
    ("constant_in_derivative", H + "inputs:\n  x: [N]\noutputs:\n  y: (-2) ** x\n",
     "specs/x.yaml:6: output 'y': its derivative with respect to x has a constant that is not a finite real number "
     "(it is complex)"),
    ("param_bad_type", H + "inputs:\n  x: [N]\nparams:\n  s: {type: double, default: 1.0}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's': type must be float or int, got 'double'"),
    ("param_missing_type", H + "inputs:\n  x: [N]\nparams:\n  s: {default: 1.0}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: missing required key 'type' in param 's' (float or int; or 'choices' instead)"),
    ("param_missing_default", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, min: 0.0}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: missing required key 'default' in param 's'"),
    ("param_default_not_number", H + "inputs:\n  x: [N]\nparams:\n  s:\n    type: float\n    default: one\noutputs:\n  y: x * s\n",
     "specs/x.yaml:8: param 's': 'default' must be a number, got 'one'"),
    ("param_default_bool", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: yes}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's': 'default' must be a number, got boolean True"),
    # YAML 1.1 reads these as 90, 5400 and 8; a YAML 1.2 reader would not.
    ("param_default_base_60", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1:30}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's': 'default' 1:30 would be read as 90 (YAML 1.1 base 60): write the number plainly"),
    ("param_max_base_60", H + "inputs:\n  x: [N]\nparams:\n  s:\n    type: float\n    default: 1.0\n    max: 1:30:00\noutputs:\n  y: x * s\n",
     "specs/x.yaml:9: param 's': 'max' 1:30:00 would be read as 5400 (YAML 1.1 base 60): write the number plainly"),
    ("param_default_octal", H + "inputs:\n  x: [N]\nparams:\n  k: {type: int, default: 010}\noutputs:\n  y: x * k\n",
     "specs/x.yaml:6: param 'k': 'default' 010 would be read as 8 (YAML 1.1 octal): write it without a leading 0"),
    ("param_int_given_float", H + "inputs:\n  x: [N]\nparams:\n  k: {type: int, default: 2.5}\noutputs:\n  y: x * k\n",
     "specs/x.yaml:6: param 'k': 'default' must be an integer, got 2.5"),
    ("param_default_above_max", H + "inputs:\n  x: [N]\nparams:\n  s:\n    type: float\n    default: 2.0\n    max: 1.0\noutputs:\n  y: x * s\n",
     "specs/x.yaml:8: param 's': default 2.0 is greater than max 1.0"),
    ("param_default_below_min", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: -1, min: 0}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's': default -1.0 is less than min 0.0"),
    ("param_min_above_max", H + "inputs:\n  x: [N]\nparams:\n  s:\n    type: float\n    default: 0.5\n    min: 1.0\n    max: 0.0\noutputs:\n  y: x * s\n",
     "specs/x.yaml:9: param 's': min 1.0 is greater than max 0.0"),
    ("param_nan", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: .nan}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's': 'default' must be a finite number, got nan"),
    ("param_inf", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1.0, max: .inf}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's': 'max' must be a finite number, got inf"),
    ("param_huge", H + "inputs:\n  x: [N]\nparams:\n  s: {type: float, default: 1e300}\noutputs:\n  y: x * s\n",
     "specs/x.yaml:6: param 's': 'default' 1e+300 is out of range (at most 1e30 in magnitude)"),
    ("param_integer_too_large", H + "inputs:\n  x: [N]\nparams:\n  k: {type: int, default: 0x" + "f" * 5000 + "}\noutputs:\n  y: x * k\n",
     "specs/x.yaml:6: integer '0xffffffffffffffffffffffffffffffffff... is too large"),
    ("doc_two_lines", "name: op\ndoc: |\n  first line\n  second line\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:2: 'doc' must be one non-empty line"),
    ("doc_docstring_quotes", 'name: op\ndoc: \'y = x, see """notes"""\'\ninputs:\n  x: [N]\noutputs:\n  y: x\n',
     'specs/x.yaml:2: \'doc\' must not contain a backslash or \'"""\''),
    ("doc_not_string", "name: op\ndoc: [y, x]\ninputs:\n  x: [N]\noutputs:\n  y: x\n",
     "specs/x.yaml:2: 'doc' must be a string, got a list"),
    # Row reductions
    ("reduce_row_constant", H + "inputs:\n  x: [..., N]\n  s: [..., 1]\noutputs:\n  y: x - sum(s * 2)\n",
     "specs/x.yaml:7: sum(s * 2) reduces over the last dim, along which its argument is constant (built from "
     "reductions, [..., 1] inputs and params only)"),
    ("reduce_of_a_reduction", H + "inputs:\n  x: [..., N]\noutputs:\n  y: x - max(mean(x))\n",
     "specs/x.yaml:6: max(mean(x)) reduces over the last dim, along which its argument is constant (built from "
     "reductions, [..., 1] inputs and params only)"),
    ("reduce_n_only", H + "inputs:\n  x: [..., N]\n  bias: [N]\noutputs:\n  y: x - mean(bias)\n",
     "specs/x.yaml:7: mean(bias) reduces an expression of [N]-shaped inputs only: the same value for every row; "
     "reduce an expression of a full-shape input such as [..., N]"),
    ("reduce_0d", H + "inputs:\n  x: []\noutputs:\n  y: x - sum(x)\n",
     "specs/x.yaml:6: sum(...) reduces over the last dim, and this op's inputs are 0-d: there is none"),
    ("reduce_two_arguments", H + "inputs:\n  x: [..., N]\noutputs:\n  y: x - sum(x, x)\n",
     "specs/x.yaml:6: sum() takes 1 argument, got 2"),
    ("reduction_name_as_input", H + "inputs:\n  mean: [..., N]\noutputs:\n  y: mean\n",
     "specs/x.yaml:4: input name 'mean' is the name of the function 'mean' of the expression language"),
    # A matmul (issue 32): one an op, of inputs, its operands read through it only.
    ("matmul_two", H + "inputs:\n  x: [..., K]\n  w: [N, K]\n  v: [N, K]\nlet:\n  h: x @ T(w)\n"
     "outputs:\n  y: h * (x @ T(v))\n",
     "specs/x.yaml:10: an op takes one matmul: x @ T(v) here, x @ T(w) at line 8"),
    ("matmul_of_expression", H + "inputs:\n  x: [..., K]\n  w: [N, K]\noutputs:\n  y: (x + 1) @ T(w)\n",
     "specs/x.yaml:7: '(x + 1) @ T(w)': @ multiplies two inputs, as x @ weight (weight [K, N]) or x @ T(weight) "
     "(weight [N, K]); a low-rank product, as (x @ T(lora_a)) @ T(lora_b); or a hidden layer, a function of one "
     "matmul and [H] inputs, as relu(x @ T(w1) + b1) @ T(w2)"),
    ("matmul_transpose_alone", H + "inputs:\n  x: [..., N]\n  w: [N, N]\noutputs:\n  y: x * T(w)\n",
     "specs/x.yaml:7: T(...) transposes a matmul's right operand: write x @ T(weight), weight [N, K]"),
    ("matmul_operand_read", H + "inputs:\n  x: [..., K]\n  w: [K, K]\noutputs:\n  y: x @ w + x\n",
     "specs/x.yaml:7: 'x' is an operand of x @ w and cannot also be read elementwise"),
    ("matmul_linear_layout", H + "inputs:\n  x: [..., K]\n  w: [N, K]\noutputs:\n  y: x @ w\n",
     "specs/x.yaml:7: 'x @ w': x's last dim K is not w's first dim N (nn.Linear's [N, K] weight is written "
     "x @ T(weight))"),
    ("matmul_row_reduction", H + "inputs:\n  x: [..., K]\n  w: [N, K]\noutputs:\n  y: softmax_like(x)\n"
     .replace("softmax_like(x)", "exp(x @ T(w)) / sum(exp(x @ T(w)))"),
     "specs/x.yaml:7: row reductions (sum, mean, max, min, take) in an op with a matmul (x @ T(w)) are not "
     "supported yet"),
    ("matmul_of_itself", H + "inputs:\n  x: [N, N]\noutputs:\n  y: x @ T(x)\n",
     "specs/x.yaml:6: 'x @ T(x)': a matmul of an input with itself is not supported yet"),
    ("matmul_name_t", H + "inputs:\n  T: [..., N]\noutputs:\n  y: T\n",
     "specs/x.yaml:4: input name 'T' is the name of the function 'T' of the expression language"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An output folder as a good build leaves it, plus a generated file whose spec is gone."""
    root = tmp_path_factory.mktemp("built")
    specs = root / "specs"
    specs.mkdir()
    (specs / "a_good.yaml").write_text(GOOD, encoding="utf-8")
    out = root / "out"
    assert cli.main(["build", str(specs), "-o", str(out)]) == 0
    # A successful build would delete this one; a failed build must not.
    (out / "gone.py").write_text("# gone: generated by fusegen from specs/gone.yaml; do not edit.\n", encoding="utf-8")
    return specs / "a_good.yaml", out


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every path under folder: files with their bytes and modification time, folders as None."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def _write(path: Path, text: str | bytes) -> None:
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))


@pytest.mark.parametrize("text, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_spec_fails_the_build_cleanly(tmp_path, capsys, built, text, message):
    good, built_out = built
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(good, specs / "a_good.yaml")
    _write(specs / "x.yaml", text)
    out = tmp_path / "out"
    shutil.copytree(built_out, out)
    before = _snapshot(out)
    capsys.readouterr()

    assert cli.main(["build", str(specs), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == message + "\n"
    assert captured.out == ""
    assert _snapshot(out) == before


def test_cases_are_distinct_one_line_messages():
    ids = [case[0] for case in CASES]
    assert len(set(ids)) == len(ids)
    for _, _, message in CASES:
        assert "\n" not in message and message.startswith("specs/x.yaml:")


def test_nothing_was_run(tmp_path, monkeypatch, capsys):
    """The hostile cases (a python/object tag, __import__) executed nothing."""
    monkeypatch.chdir(tmp_path)
    specs = tmp_path / "specs"
    specs.mkdir()
    hostile = {
        "tag": H + "inputs: {x: [N]}\noutputs:\n  y: !!python/object/apply:os.system [touch pwned]\n",
        "call": H + "inputs: {x: [N]}\noutputs:\n  y: \"__import__('os').system('touch pwned')\"\n",
        "state": H + "inputs: {x: [N]}\noutputs:\n  y: !!python/object/new:os.system [touch pwned]\n",
    }
    for name, text in hostile.items():
        _write(specs / "x.yaml", text)
        assert cli.main(["build", str(specs), "-o", str(tmp_path / "out")]) == 2
        assert len(capsys.readouterr().err.splitlines()) == 1
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["check", "show", "build-file"])
def test_other_commands_fail_the_same_way(tmp_path, capsys, command):
    specs = tmp_path / "specs"
    specs.mkdir()
    _write(specs / "x.yaml", H + "inputs:\n  x: [N]\noutputs:\n  y: gelux(x)\n")
    out = tmp_path / "out"
    argv = {
        "check": ["check", str(specs), "-o", str(out)],
        "show": ["show", str(specs / "x.yaml")],
        "build-file": ["build", str(specs / "x.yaml"), "-o", str(out)],
    }[command]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("specs/x.yaml:6: unknown function 'gelux' (known: ")
    assert captured.err.count("\n") == 1
    assert captured.out == ""
    assert not out.exists()


# ---------------------------------------------------------------------------
# Any bytes at all: a spec loads, or fails with one SpecError line. Never another exception.

SEED = (ROOT / "specs" / "bias_gelu_dropout_add.yaml").read_text(encoding="utf-8")

# YAML's and Python's special characters, and things that look like numbers or tags.
SNIPPETS = [
    "&a ", "*a", "!!python/object:os.system ", "!x ", "!!int ", "!!binary ", "[", "]", "{", "}", ":", ": ",
    "- ", "\t", "'", '"', "%", "@", "`", "|", ">", "#", "? ", "<<: ", "\x00", "\x85", "\ufeff", "\\",
    "\n", " ", "...", "---\n", "~", "1e5", ".nan", "0x", "\U0001d465", "é", "__import__('os')", ".", ",", "9" * 5000,
]


def _load_or_spec_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "specs" / "x.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    try:
        build_ir(load_spec(path))
    except SpecError as exc:
        message = str(exc)
        assert message.startswith("specs/x.yaml") and "\n" not in message, (data, message)


def test_every_truncation_loads_or_fails_cleanly(tmp_path):
    data = SEED.encode("utf-8")
    for end in range(len(data)):
        _load_or_spec_error(tmp_path, data[:end])


def test_random_edits_load_or_fail_cleanly(tmp_path):
    rng = random.Random(20240601)
    for _ in range(1000):
        at = rng.randrange(len(SEED) + 1)
        if rng.random() < 0.2:
            text = SEED[:at] + SEED[at + rng.randint(1, 8):]  # a deletion
        else:
            text = SEED[:at] + rng.choice(SNIPPETS) + SEED[at:]
        _load_or_spec_error(tmp_path, text.encode("utf-8"))


def test_random_bytes_load_or_fail_cleanly(tmp_path):
    rng = random.Random(7)
    for _ in range(300):
        data = bytearray(SEED.encode("utf-8"))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        _load_or_spec_error(tmp_path, bytes(data))
