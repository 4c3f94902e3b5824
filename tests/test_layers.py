"""The packages' layers: each imports only those below it (a function's own imports included), so a package can be
read, tested and replaced with what lies under it alone."""

from __future__ import annotations

import ast
from pathlib import Path

import edgerun

# Bottom to top. A module or package of edgerun/ imports only those before it in this list.
LAYERS = (
    "errors",  # one-line errors every layer raises
    "cache",  # where downloads and built files are kept
    "memory",  # this process's memory: peak RSS, huge pages, mapped files let go
    "tables",  # CSV result tables
    "llamacpp",  # llama.cpp built from its sdist: ggml's libraries, the anchor's binaries
    "model",  # model files, tokenizers, engines, the generation loop
    "net",  # wire formats, sockets, loss and shaping
    "sched",  # the planners: pure functions of profiles
    "profile",  # measuring this device
    "sap",  # semantic-aware predictors
    "tp",  # tensor parallelism
    "pp",  # pipeline parallelism, browser tabs
    "tune",  # LoRA tuning over a pipeline
    "moe",  # experts on workers
    "serve",  # the HTTP API and its clusters
    "bench",  # benchmarks of everything above
    "commands",  # the command line's subcommands
    "cli",  # the `edgerun` parser
)
ROOT = Path(edgerun.__file__).parent


def imported_parts(path: Path) -> set[str]:
    """The top-level parts of edgerun (edgerun.X) a source file imports, anywhere in it."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "edgerun" and node.level == 0:  # from edgerun import X
            names = [f"edgerun.{a.name}" for a in node.names if a.name != "__version__"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        parts |= {name.split(".")[1] for name in names if name.startswith("edgerun.")}
    return parts


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert parts == set(LAYERS), (parts - set(LAYERS), set(LAYERS) - parts)


def test_each_layer_imports_only_those_below_it() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue
        part = relative.parts[0].removesuffix(".py")
        below = set(LAYERS[:LAYERS.index(part)])
        upward += [f"{relative} imports edgerun.{other}" for other in imported_parts(path) - below - {part}]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """A function's own import counts as the module's."""
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom edgerun.model import loader\nfrom edgerun import __version__, llamacpp\n\n"
                      "def f():\n    from edgerun.serve.app import Api\n    import edgerun.tp.master\n")
    assert imported_parts(source) == {"model", "llamacpp", "serve", "tp"}
