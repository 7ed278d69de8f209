"""`fusegen list` and `fusegen new`."""
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
