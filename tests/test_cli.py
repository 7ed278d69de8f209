"""`fusegen list`, `show`, `new`, `check`'s advice, --version and `python -m fusegen`."""
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
