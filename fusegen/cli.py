"""`fusegen build | check | show | list | new | bench | profile | native | kernels-repo`:
orchestration only; each stage lives in its module. bench and profile bring torch in, so they
are imported only when run."""
from __future__ import annotations

import dataclasses

import argparse
import os
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from . import ir, outdir, plan, planning, simplify, spec, write
from .backends import BACKENDS, DEFAULT, Unsupported, codegen
from .errors import SpecError
from .kinds import KINDS

DEFAULT_SPECS = Path("specs")
DEFAULT_OUT = Path("generated")


@dataclass(frozen=True)
class BuiltOp:
    spec: spec.OpSpec
    simplified: simplify.SimplifiedOp
    plan: plan.OpPlan
    text: str  # the module's
    beside: dict[str, str] = field(default_factory=dict)  # files beside the module: name → text

    @property
    def files(self) -> dict[str, str]:
        """Every file of the op, its module first."""
        return {f"{self.spec.name}.py": self.text, **self.beside}


def spec_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                raise SpecError(str(path), None, _no_specs_message(path))
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise SpecError(str(path), None, "no such spec file or directory")
    return files


def _no_specs_message(folder: Path) -> str:
    if outdir.generated_modules(folder):  # `fusegen list generated/`: a likely slip
        return "no specs (*.yaml, *.yml) in this folder; it holds generated modules: give their specs folder"
    return "no specs (*.yaml, *.yml) in this folder"


def specs_or_names(items: list[str], specs_dir: Path) -> list[Path]:
    """Spec files and directories as given; a word that is neither is an op name, whose spec
    is looked up in `specs_dir` (as `fusegen bench NAME` does)."""
    paths = []
    for item in items:
        if Path(item).exists() or not item.isidentifier():
            paths.append(Path(item))  # spec_files reports one that does not exist
        else:
            paths.append(spec.find_spec(item, specs_dir))
    return paths


def build_op(path: Path, backend_name: str | None = None, name: str | None = None) -> BuiltOp:
    """`backend_name`: the backend asked for (--backend), over the spec's own (`backend:`), over
    the default; `name`: the op under another name (its library ops beside the spec's own op's:
    `fusegen bench --backend`)."""
    op_spec = spec.load_spec(path)
    if name is not None:
        op_spec = dataclasses.replace(op_spec, name=name)
    simplified = simplify.simplify(ir.build_ir(op_spec))
    chosen = backend_name or op_spec.backend or DEFAULT
    backend = codegen(chosen)
    op_plan = planning.plan(simplified, backend.RESERVED_NAMES, backend.MODULE_IMPORTS)
    try:
        text, beside = backend.render(op_plan), backend.beside(op_plan)
    except Unsupported as exc:
        if backend_name is None and op_spec.backend is not None:
            raise SpecError(str(path), op_spec.backend_line, f"backend {chosen}: {exc}") from None
        raise SpecError(str(path), None, f"--backend {chosen}: {exc}") from None
    write.check_module(text, f"{op_spec.name}.py")
    return BuiltOp(op_spec, simplified, op_plan, text, beside)


@dataclass(frozen=True)
class Build:
    files: dict[str, str]  # file name → text: the built ops' modules and __init__.py
    ops: int  # how many ops this build generated
    kept: list[outdir.GeneratedModule]  # fusegen's other modules in the folder, left as they are
    stale: list[outdir.GeneratedModule]  # fusegen's modules whose spec is gone from a built directory
    # fusegen's files beside a module that this build no longer writes (a stale module's, or the
    # <op>.cu of an op built with another backend now)
    orphans: list[Path] = field(default_factory=list)


def generate(paths: list[Path], out: Path, backend: str | None = None) -> Build:
    """What a build of `paths` into `out` writes and removes; computed whole before anything is
    written, so that a failed build changes nothing."""
    return folder_build(build_ops(paths, backend), paths, out)


def build_ops(paths: list[Path], backend: str | None = None) -> dict[str, BuiltOp]:
    built: dict[str, BuiltOp] = {}
    for path in spec_files(paths):
        op = build_op(path, backend)
        if op.spec.name in built:
            other = built[op.spec.name].spec.path
            raise SpecError(op.spec.path, 1, f"op name '{op.spec.name}' is already defined by {other}")
        built[op.spec.name] = op
    return built


def folder_build(built: dict[str, BuiltOp], paths: list[Path], out: Path) -> Build:
    """The files of `built` and what they change in `out` as it is now."""
    kept, stale = outdir.survey(out, set(built), [p for p in paths if p.is_dir()])
    files = {name: text for op in built.values() for name, text in op.files.items()}
    orphans = [path for name in [*built, *(m.name for m in stale)] for path in outdir.beside(out, name)
               if path.name not in files]
    # __init__.py lists every op the folder will hold, kept ones included. render_package_init
    # reads only .name and .doc, which both OpSpec and GeneratedModule carry.
    files["__init__.py"] = write.render_package_init([op.spec for op in built.values()] + kept)
    return Build(files, len(built), kept, stale, orphans)


def cmd_build(args) -> int:
    out = _out_folder(args.out)
    ops = build_ops(args.paths, args.backend)  # the slow part, before the folder is touched
    try:
        with outdir.locked(out):  # planned under the lock: another build may just have changed it
            build = folder_build(ops, args.paths, out)
            written = outdir.swap_in(out, build.files, [*build.stale, *build.orphans])
    except OSError as exc:  # making the folder, its lock, finishing a killed build's swap
        where = f": {exc.filename}" if exc.filename else ""
        raise SpecError(str(out), None, f"{exc.strerror or exc}{where}") from None
    for module in build.stale:
        print(f"removed {module.path} (its spec is gone)")
    for path in build.orphans:
        print(f"removed {path} (no longer built)")
    for name in written:
        print(f"wrote {out / name}")
    kept = f"; {len(build.kept)} other generated modules left as they are" if build.kept else ""
    print(f"{build.ops} ops, {len(build.files)} files in {out}/ (__init__.py included): {len(written)} written, "
          f"{len(build.files) - len(written)} unchanged{kept}")
    return 0


def cmd_check(args) -> int:
    out = _out_folder(args.out)
    build = generate(args.paths, out, args.backend)
    stale = [
        out / name
        for name, text in sorted(build.files.items())
        if not (out / name).is_file() or (out / name).read_bytes() != text.encode("utf-8")
    ]
    stale += [module.path for module in build.stale] + build.orphans
    for path in stale:
        print(f"stale: {path}", file=sys.stderr)
    if stale:
        print(f"{out}/ is out of date: run `{_build_command(args.paths, out, args.backend)}`", file=sys.stderr)
        return 1
    print(f"{out}/ is up to date ({build.ops} ops)")
    return 0


def _out_folder(out: Path | None) -> Path:
    if out is None:
        raise SpecError("-o ''", None, "an empty path: name the output folder (-o . for this one)")
    outdir.check_folder(out)
    return out


def _build_command(paths: list[Path], out: Path, backend: str | None = None) -> str:
    """The `fusegen build` that brings `out` up to date, defaults left out."""
    words = ["fusegen", "build"]
    words += [] if paths == [DEFAULT_SPECS] else [shlex.quote(str(p)) for p in paths]
    words += [] if out == DEFAULT_OUT else ["-o", shlex.quote(str(out))]
    words += [] if backend is None else ["--backend", backend]
    return " ".join(words)


def shipped_specs() -> Path:
    """The specs of the ops fusegen ships: installed, the package fusegen.specs (see
    pyproject.toml); in a checkout or an editable install, specs/ beside the package."""
    package = Path(__file__).resolve().parent
    installed = package / "specs"
    return installed if installed.is_dir() else package.parent / "specs"


def _specs_folder(given: Path | None) -> Path:
    """--specs as given; else ./specs, or outside a checkout (no ./specs) the shipped specs."""
    if given is not None:
        return given
    return DEFAULT_SPECS if DEFAULT_SPECS.exists() else shipped_specs()


def cmd_show(args) -> int:
    op = build_op(specs_or_names([args.spec], _specs_folder(args.specs))[0])
    p = op.plan  # what the backend prints: every name as the generated code spells it
    print(f"# {op.spec.name}: {op.spec.doc}")
    print("\n## IR")
    for name, expr in op.simplified.ir.outputs:
        print(f"{name} = {expr}")
    for heading, lines in KINDS[p.kind].sections(p):
        if lines:
            print(f"\n## {heading}")
            print("\n".join(lines))
    for source, output in p.passthrough:
        print(f"grad_{source} = grad_{output}  (passed through, no copy)")
    for name, source in p.same_gradient:
        print(f"grad_{name} = grad_{source}  (the same values: written once where shapes and dtypes agree)")
    for helper in p.helpers:
        print(f"\n## choice '{helper.param.name}'")
        for index, (choice, body) in enumerate(helper.forward):
            print(f"{choice}: {_inline(body)}")
            for k, partials in enumerate(helper.derivatives):
                print(f"  d/d{helper.args[k]}: {_inline(partials[index][1])}")
    print("\n## generated module\n")
    print(op.text)
    return 0


def cmd_list(args) -> int:
    """Every spec that loads is listed; each that does not (or a path or name not found) is
    said on stderr, and the exit status is 2."""
    specs = _specs_folder(args.specs)
    failed = 0
    for item in args.paths or [None]:  # None: the specs folder
        try:
            files = spec_files([specs] if item is None else specs_or_names([item], specs))
        except SpecError as exc:
            print(exc, file=sys.stderr)
            files, failed = [], failed + 1
        for path in files:
            try:
                op = ir.build_ir(spec.load_spec(path))
            except SpecError as exc:
                print(exc, file=sys.stderr)
                failed += 1
                continue
            signature = planning.public_signature(op.spec, has_dropout=bool(op.dropouts))
            print(f"{op.spec.name}({signature})\n    {op.spec.doc}")
    return 2 if failed else 0


def cmd_new(args) -> int:
    target: Path = args.dir / f"{args.name}.yaml"
    text = write.render_starter_spec(args.name)
    # Before anything is written: every op name a build refuses, by the spec's rules and the backend's.
    spec.check_op_name(args.name, str(target))
    planning.check_op_name(args.name, str(target), None, codegen().MODULE_IMPORTS)
    if args.dir.exists() and not args.dir.is_dir():
        raise SpecError(str(args.dir), None, "is not a folder: give --dir the folder to write NAME.yaml into")
    if target.exists():
        raise SpecError(str(target), None, "already exists; choose another name or edit it")
    try:
        # A spec of another file name may define the op already: the folder's build would refuse both.
        for other in sorted(args.dir.iterdir()) if args.dir.is_dir() else []:
            if other.suffix in (".yaml", ".yml") and other.is_file() and _op_name(other) == args.name:
                raise SpecError(str(target), None, f"op name '{args.name}' is already defined by {other}")
        write.write_if_changed(target, text)
    except OSError as exc:  # --dir under a file, an unreadable or read-only folder
        raise SpecError(str(target), None, f"cannot write: {exc.strerror}") from None
    print(f"wrote {target}: edit it, then `fusegen build`")
    return 0


def _op_name(path: Path) -> str | None:
    try:
        return spec.load_spec(path).name
    except SpecError:  # the build says what is wrong with it; it defines no op meanwhile
        return None


def _inline(block: plan.Body) -> str:
    return "; ".join(f"{t} = {e}" for t, e in (*block.temps, *block.results))


def cmd_kernels_repo(args) -> int:
    from .integrations import hub_layers  # no torch, kernels nor transformers: only when loaded

    if args.folder is None:
        raise SpecError("''", None, "an empty path: name the repository's folder (. for this one)")
    backends = tuple(dict.fromkeys(args.backend or ["cuda"]))
    written, removed, total = hub_layers.write_repo(args.folder, backends)
    for path in removed:
        print(f"removed {path} (its backend was not asked for)")
    for name in written:
        print(f"wrote {args.folder / name}")
    names = ", ".join(layer.name for layer in hub_layers.LAYERS)
    print(f"{len(hub_layers.LAYERS)} layers ({names}) for {', '.join(backends)} in {args.folder}/: "
          f"{len(written)} files written, {total - len(written)} unchanged")
    print(f"use: with kernels.use_kernel_mapping(fusegen.integrations.hub_layers.kernel_mapping("
          f"{str(args.folder)!r})): kernels.kernelize(model, mode=..., device={backends[0]!r})")
    return 0


def cmd_bench(args) -> int:
    from . import bench

    return bench.run_bench(args)


def cmd_profile(args) -> int:
    from . import profile

    return profile.run_profile(args)


def cmd_native(args) -> int:
    from .runtime import native

    if native.mode() == "off":
        print(native.status())
        return 0
    with warnings.catch_warnings():  # the warning a failed build gives an op call: said below, once
        warnings.simplefilter("ignore")
        module = native.load(build=True)
    print(native.status())
    return 0 if module is not None else 1


def _version() -> str:
    try:
        return f"fusegen {metadata.version('fusegen')}"
    except metadata.PackageNotFoundError:
        return "fusegen (not installed: no package metadata; pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="fusegen", description="Fused elementwise Triton kernels from YAML specs.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)

    for name, help_text in [
        ("build", "generate modules from specs (default: specs/ -> generated/)"),
        ("check", "exit 1, naming each stale file, when the output folder differs from a fresh build"),
    ]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("paths", nargs="*", type=Path, default=[DEFAULT_SPECS], metavar="SPEC_OR_DIR")
        command.add_argument("-o", "--out", type=lambda text: Path(text) if text else None,  # "" is refused, not "."
                             default=DEFAULT_OUT, help="output folder (default: generated)")
        command.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                             help="the kernels' language, over each spec's own `backend:`: triton (the default), or "
                                  "cuda (CUDA C++ compiled by NVRTC on first use: the pointwise and row kinds; an op with a "
                                  "matmul is refused in one line)")
    show = commands.add_parser("show", help="print a spec's IR, simplified/CSE'd forms, gradients and generated code")
    show.add_argument("spec", metavar="SPEC_OR_NAME", help="a spec file, or an op name looked up in --specs")
    listing = commands.add_parser("list", help="every op with its signature and doc")
    listing.add_argument("paths", nargs="*", metavar="SPEC_DIR_OR_NAME", help="what to list (default: --specs)")
    for command in (show, listing):
        command.add_argument("--specs", type=Path, default=None, metavar="DIR",
                             help="the specs folder, where op names are looked up "
                                  "(default: specs, or where there is none, the specs fusegen ships)")
    new = commands.add_parser("new", help="write a commented starter spec that builds as it is")
    new.add_argument("name", help="the op's name, a Python identifier")
    new.add_argument("--dir", type=Path, default=DEFAULT_SPECS, help="where to write NAME.yaml (default: specs)")

    # bench and profile define their arguments next to their code, which imports torch: only
    # when one of them is the command (the top level takes no option with a value, so the
    # first word that is not an option is the command).
    bench_parser = commands.add_parser("bench", help="time ops against eager PyTorch and torch.compile (GPU)")
    profile_parser = commands.add_parser("profile", help="torch.profiler tables: eager, generated, compiled (GPU)")
    commands.add_parser("native", help="build the C++ autograd node (used from then on) and say where it is")
    kernels_repo = commands.add_parser(
        "kernels-repo", help="write a local repository of layers for Hugging Face's kernels (transformers models)")
    kernels_repo.add_argument("folder", type=lambda text: Path(text) if text else None, metavar="FOLDER",
                              help="the repository's folder (made if missing)")
    kernels_repo.add_argument("--backend", action="append", choices=("cuda", "cpu"),
                              help="a build variant to write, once each (default: cuda); cpu runs the "
                                   "kernels on Triton's CPU interpreter (TRITON_INTERPRET=1) only")
    chosen = next((word for word in argv if not word.startswith("-")), None)
    if chosen == "bench":
        from . import bench

        bench.add_bench_arguments(bench_parser)
    elif chosen == "profile":
        from . import profile

        profile.add_profile_arguments(profile_parser)

    args = parser.parse_args(argv)
    handlers = {
        "build": cmd_build,
        "check": cmd_check,
        "show": cmd_show,
        "list": cmd_list,
        "new": cmd_new,
        "bench": cmd_bench,
        "profile": cmd_profile,
        "native": cmd_native,
        "kernels-repo": cmd_kernels_repo,
    }
    try:
        return handlers[args.command](args)
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return 2
    except write.GeneratedCodeError as exc:
        print(f"internal error: {exc}", file=sys.stderr)
        return 3
    except BrokenPipeError:  # `fusegen show op | head`: the reader left; nothing more to say
        # Python would print its own error flushing stdout at exit: point it at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
