"""`fusegen list`, `show`, `new`, `check`'s advice, --version and `python -m fusegen`."""
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from fusegen import cli

ROOT = Path(__file__).resolve().parent.parent


def test_list_prints_every_op_with_signature_and_doc(capsys):
    assert cli.main(["list", str(ROOT / "specs")]) == 0
    out = capsys.readouterr().out
    assert "bias_gelu_dropout_add(x, bias, residual, p=0.1, activation='gelu_tanh', training=True, seed=None, *, out=None)\n" in out
    assert "    y = dropout(activation(x + bias), p) + residual\n" in out
    assert out.count("\n    ") == len(list((ROOT / "specs").glob("*.yaml")))


def test_new_writes_a_starter_spec_that_builds(tmp_path, capsys):
    specs = tmp_path / "specs"
    assert cli.main(["new", "my_op", "--dir", str(specs)]) == 0
    assert (specs / "my_op.yaml").read_text().startswith("# A fusegen spec")
    assert cli.main(["build", str(specs), "-o", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "my_op.py").is_file()


def test_new_refuses_to_overwrite_or_bad_names(tmp_path, capsys):
    specs = tmp_path / "specs"
    assert cli.main(["new", "my_op", "--dir", str(specs)]) == 0
    before = (specs / "my_op.yaml").read_bytes()
    capsys.readouterr()
    assert cli.main(["new", "my_op", "--dir", str(specs)]) == 2
    assert capsys.readouterr().err == f"{specs / 'my_op.yaml'}: already exists; choose another name or edit it\n"
    assert (specs / "my_op.yaml").read_bytes() == before
    assert cli.main(["new", "class", "--dir", str(specs)]) == 2
    assert capsys.readouterr().err == f"{specs / 'class.yaml'}: op name 'class' is a Python keyword\n"
    assert not (specs / "class.yaml").exists()


# Names `fusegen new` could be given: Python's builtins, the generated module's imports and
# own names, the starter spec's names, keywords and soft keywords, the module class's names.
NEW_NAMES = [
    "print", "sum", "len", "type", "torch", "tl", "F", "triton", "libdevice", "runtime", "launch", "tuning",
    "reference", "eager", "rows", "self", "seed", "training", "out", "x", "bias", "residual", "scale",
    "activation", "h", "y", "gelu", "Gelu", "annotations", "match", "class", "_op", "OPS", "my_op",
]


def test_new_refuses_every_name_the_build_refuses(tmp_path, capsys):
    """Either `new` refuses NAME (one line, exit 2, nothing written), or its spec builds."""
    built = 0
    for name in NEW_NAMES:
        specs = tmp_path / "specs" / name
        code = cli.main(["new", name, "--dir", str(specs)])
        err = capsys.readouterr().err
        if code != 0:
            assert code == 2 and err.count("\n") == 1 and f"'{name}'" in err, (name, err)
            assert not specs.exists(), name
            continue
        assert cli.main(["build", str(specs), "-o", str(tmp_path / "gen" / name)]) == 0, (name, capsys.readouterr().err)
        built += 1
    assert 0 < built < len(NEW_NAMES)


def test_new_with_dir_at_a_file_or_an_op_already_defined_is_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert cli.main(["new", "my_op", "--dir", str(afile)]) == 2
    assert capsys.readouterr().err == f"{afile}: is not a folder: give --dir the folder to write NAME.yaml into\n"
    assert cli.main(["new", "my_op", "--dir", str(afile / "sub")]) == 2
    assert capsys.readouterr().err == f"{afile / 'sub' / 'my_op.yaml'}: cannot write: Not a directory\n"
    assert afile.read_text() == ""
    # A spec of another file name defines my_op: the folder's build would refuse a second one.
    specs = tmp_path / "specs"
    assert cli.main(["new", "my_op", "--dir", str(specs)]) == 0
    (specs / "my_op.yaml").rename(specs / "mine.yaml")
    capsys.readouterr()
    assert cli.main(["new", "my_op", "--dir", str(specs)]) == 2
    assert capsys.readouterr().err == f"{specs / 'my_op.yaml'}: op name 'my_op' is already defined by {specs / 'mine.yaml'}\n"
    assert sorted(p.name for p in specs.iterdir()) == ["mine.yaml"]


# ---------------------------------------------------------------------------
# One CLI: op names or paths, --version, python -m fusegen, empty folders, check's advice


def test_show_and_list_take_op_names_or_paths(capsys):
    specs = ["--specs", str(ROOT / "specs")]
    assert cli.main(["list", "swiglu", str(ROOT / "specs" / "gelu.yaml"), *specs]) == 0
    assert capsys.readouterr().out == (
        "swiglu(x, *, out=None)\n    y = silu(a) * b, where x = [a, b] along the last dim\n"
        "gelu(x, *, out=None)\n    y = gelu(x), exact (erf) form\n"
    )
    assert cli.main(["list", *specs]) == 0  # no argument: the --specs folder
    assert capsys.readouterr().out.count("\n    ") == len(list((ROOT / "specs").glob("*.yaml")))
    assert cli.main(["show", "swiglu", *specs]) == 0
    by_name = capsys.readouterr().out
    assert cli.main(["show", str(ROOT / "specs" / "swiglu.yaml")]) == 0
    assert capsys.readouterr().out == by_name
    assert by_name.startswith("# swiglu: y = silu(a) * b")


def test_an_unknown_name_or_path_is_one_line(capsys, tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "gelu.yaml").write_bytes((ROOT / "specs" / "gelu.yaml").read_bytes())
    assert cli.main(["show", "no_such_op", "--specs", str(specs)]) == 2
    assert capsys.readouterr().err == f"{specs}: no spec for op 'no_such_op' (give a spec path, or --specs DIR)\n"
    assert cli.main(["list", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"{tmp_path / 'nowhere'}: no such spec file or directory\n"


def test_list_goes_on_past_bad_specs_and_says_each(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("gelu", "swiglu"):
        (specs / f"{name}.yaml").write_bytes((ROOT / "specs" / f"{name}.yaml").read_bytes())
    (specs / "bad_name.yaml").write_text("name: bad-name\ndoc: d\ninputs: {x: [N]}\noutputs: {y: x}\n")
    (specs / "bad_expr.yaml").write_text("name: bad_expr\ndoc: d\ninputs: {x: [N]}\noutputs: {y: gelux(x)}\n")
    assert cli.main(["list", str(specs), "no_such_op", str(ROOT / "specs" / "relu.yaml"), "--specs", str(specs)]) == 2
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if not line.startswith(" ")] == [
        "gelu(x, *, out=None)", "swiglu(x, *, out=None)"
    ]
    err = captured.err.splitlines()
    assert len(err) == 4
    assert err[0].startswith("specs/bad_expr.yaml:4: unknown function 'gelux'")
    assert err[1] == "specs/bad_name.yaml:1: op name 'bad-name' is not a Python identifier"
    assert err[2] == f"{specs}: no spec for op 'no_such_op' (give a spec path, or --specs DIR)"
    assert err[3] == f"{ROOT / 'specs' / 'relu.yaml'}: no such spec file or directory"


def test_show_and_list_outside_a_checkout_read_the_shipped_specs(tmp_path):
    """No ./specs: `show NAME` and `list` fall back on the specs fusegen ships (here: the
    checkout's, as the package is imported from it; an installed wheel's: tests/test_install.py)."""
    def run(*argv: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's fusegen, whatever is installed
        return subprocess.run([sys.executable, "-m", "fusegen", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    result = run("show", "swiglu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# swiglu: y = silu(a) * b")
    result = run("list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n    ") == len(list((ROOT / "specs").glob("*.yaml")))
    # A ./specs of the user's own is still the default: no fallback past it.
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "gelu.yaml").write_bytes((ROOT / "specs" / "gelu.yaml").read_bytes())
    result = run("list")
    assert result.returncode == 0 and result.stdout == "gelu(x, *, out=None)\n    y = gelu(x), exact (erf) form\n"
    result = run("show", "swiglu")
    assert result.returncode == 2 and result.stderr == "specs: no spec for op 'swiglu' (give a spec path, or --specs DIR)\n"


def test_a_folder_without_specs_says_so(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (["list", str(empty)], ["build", str(empty), "-o", str(tmp_path / "out")], ["check", str(empty)]):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == f"{empty}: no specs (*.yaml, *.yml) in this folder\n"
    assert not (tmp_path / "out").exists()
    assert cli.main(["list", str(ROOT / "generated")]) == 2
    assert capsys.readouterr().err == (
        f"{ROOT / 'generated'}: no specs (*.yaml, *.yml) in this folder; "
        "it holds generated modules: give their specs folder\n"
    )


def test_check_names_the_folder_and_the_build_that_mends_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my specs").mkdir()
    (tmp_path / "my specs" / "gelu.yaml").write_bytes((ROOT / "specs" / "gelu.yaml").read_bytes())
    assert cli.main(["check", "my specs", "-o", "mygen"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "mygen/ is out of date: run `fusegen build 'my specs' -o mygen`"
    assert cli.main(["build", "my specs", "-o", "mygen"]) == 0
    assert cli.main(["check", "my specs", "-o", "mygen"]) == 0
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "gelu.yaml").write_bytes((ROOT / "specs" / "gelu.yaml").read_bytes())
    assert cli.main(["check"]) == 1  # the defaults: specs/ -> generated/
    assert capsys.readouterr().err.splitlines()[-1] == "generated/ is out of date: run `fusegen build`"


def _run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_version_and_python_m_fusegen(tmp_path):
    result = _run("-m", "fusegen", "--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == f"fusegen {metadata.version('fusegen')}\n"
    result = _run("-m", "fusegen", "list", str(ROOT / "specs" / "gelu.yaml"), cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("gelu(x, *, out=None)\n")


def test_build_check_list_show_import_neither_bench_nor_torch(tmp_path):
    """bench and profile (and torch with them) load only for `fusegen bench` and `profile`."""
    spec = str(ROOT / "specs" / "gelu.yaml")
    out = str(tmp_path)
    commands = [["list", spec], ["show", spec], ["build", spec, "-o", out], ["check", spec, "-o", out]]
    code = (
        "import sys; from fusegen import cli\n"
        f"for argv in {commands!r}:\n"
        "    assert cli.main(argv) == 0, argv\n"
        "    loaded = [m for m in ('fusegen.bench', 'fusegen.profile', 'torch') if m in sys.modules]\n"
        "    print('loaded after', argv[0], loaded)\n"
    )
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("loaded after")] == [
        f"loaded after {command} []" for command in ("list", "show", "build", "check")
    ]
    result = _run("-m", "fusegen", "bench", "--help")  # bench still gets its arguments
    assert result.returncode == 0 and "--dtype" in result.stdout


def test_native_without_a_compiler_names_the_cause(tmp_path, monkeypatch, capsys):
    """Not ninja's "build stopped": the missing compiler, in one line."""
    from fusegen.runtime import native

    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSEGEN_NATIVE", "on")
    native.build_directory.cache_clear()
    try:
        for env, looked in [
            ({"CXX": str(tmp_path / "no-c++")}, f"$CXX is '{tmp_path / 'no-c++'}'"),
            ({"PATH": str(tmp_path)}, "looked for 'c++' on PATH, or $CXX"),
        ]:
            monkeypatch.setattr(native._state, "module", None)
            monkeypatch.setattr(native._state, "failed", None)
            monkeypatch.delenv("CXX", raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            assert cli.main(["native"]) == 1
            captured = capsys.readouterr()
            assert captured.out == (
                f"unavailable: RuntimeError: no C++ compiler found ({looked}): install one (g++ or clang++), or set CXX\n"
            )
            assert captured.err == ""
    finally:
        native.build_directory.cache_clear()


def test_show_into_a_pipe_closed_early_says_nothing():
    """`fusegen show op | head -1`: the reader leaves; no BrokenPipeError traceback."""
    shown = subprocess.Popen([sys.executable, "-m", "fusegen", "show", "scaled_masked_softmax_dropout"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    shown.stdout.readline()
    shown.stdout.close()  # as head does after its line
    errors = shown.stderr.read().decode()
    shown.wait(timeout=120)
    assert errors == ""
