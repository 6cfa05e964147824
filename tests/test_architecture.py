"""The layering of docs/architecture.md, checked on the source: every import of a frugaltrain
module (static or through importlib) points down the picture, and no function outside the
Triton kernel is longer than 80 lines; the control plane (cluster/) imports no torch, and the
coordinator, which trains nothing, runs without it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tomllib

SRC = Path(__file__).resolve().parents[1] / "src" / "frugaltrain"

# Lower numbers sit lower. A module may import its own part and anything strictly lower; parts on
# one level are independent of each other.
LEVEL = {
    "inject": 0,  # the grammar of fault_tolerance.inject, which the config checks
    "codecs": 0,  # the codecs and their grammar (codecs/grammar.py), which the config checks
    "processes": 0,  # worker processes forked from one import of torch (train/ and flow/)
    "config": 1,
    "data": 2,
    "models": 2,
    "forge": 2,
    "energy": 2,
    "metrics": 3,
    "optim": 3,
    "cluster": 4,  # the control plane, torch-free: comm/'s rendezvous code uses its keys and JSON
    "comm": 5,
    "outer": 6,
    "step": 6,  # one inner step, shared by train/ and sim/
    "sim": 7,
    "flow": 7,
    "outer_loop": 7,  # the library entry (frugaltrain.wrap): outer, comm, config and lower
    "train": 8,  # over sim/: the launcher plans outer.strategy = "auto" with sim/plan.py
    "netlab": 9,
    "cli": 10,
    "__main__": 11,
    "__init__": 11,
}
# What cluster/ may import besides itself: it must run where torch is not installed.
CLUSTER_MAY_IMPORT = {"config", "metrics", "inject", "codecs"}
KERNELS = {"forge/triton_kernel.py:_fused_wgrad_kernel"}  # launch arguments one per line


def _part(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(tree: ast.AST) -> list[str]:
    """frugaltrain parts named by imports and by importlib strings in a module."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names += re.findall(r"^frugaltrain(?:\.\w+)+$", node.value)
    parts = []
    for name in names:
        bits = name.split(".")
        if bits[0] == "frugaltrain" and len(bits) > 1:
            parts.append(bits[1])
    return parts


def test_every_import_points_down():
    upward = []
    for path in SRC.rglob("*.py"):
        me = _part(path)
        for other in _imports(ast.parse(path.read_text())):
            if other != me and LEVEL[other] >= LEVEL[me]:
                upward.append(f"{path.relative_to(SRC)} imports frugaltrain.{other}")
    assert not upward, "\n".join(sorted(set(upward)))


def test_every_part_has_a_level():
    parts = {_part(p) for p in SRC.rglob("*.py")}
    assert parts <= set(LEVEL), sorted(parts - set(LEVEL))


def test_no_function_longer_than_80_lines():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{path.relative_to(SRC)}:{node.name}"
                lines = node.end_lineno - node.lineno + 1
                if lines > 80 and name not in KERNELS:
                    long.append(f"{name} ({lines} lines)")
    assert not long, long


def _sibling_imports(path: Path) -> set[str]:
    """Modules of path's own subpackage that path imports (anywhere in it, inside functions and
    TYPE_CHECKING blocks too): `frugaltrain.pkg.mod`, `from frugaltrain.pkg import mod`, and the
    package's __init__ for other names taken from `frugaltrain.pkg`."""
    pkg = path.parent
    here = f"frugaltrain.{pkg.name}"
    siblings = {p.stem for p in pkg.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules, names = [a.name for a in node.names], []
        elif isinstance(node, ast.ImportFrom) and node.level <= 1:  # level 1: this package
            module = f"{here}.{node.module or ''}".rstrip(".") if node.level else node.module
            modules, names = [module], [a.name for a in node.names]
        else:
            continue
        for module in modules:
            if module == here:  # the package: its submodules by name, else its __init__
                found |= {n if n in siblings else "__init__" for n in names or ["__init__"]}
            elif module.startswith(here + "."):
                found.add(module.split(".")[2])
    return found - {path.stem}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle of graph, each once: started at its smallest module."""
    cycles = []

    def walk(start: str, node: str, chain: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                cycles.append([*chain, start])
            elif nxt > start and nxt not in chain:
                walk(start, nxt, [*chain, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return cycles


def test_no_import_circle_inside_a_subpackage():
    """Within one subpackage, module imports form no circle, so each module can be read (and
    imported) after the ones it uses; an import inside a function counts too."""
    circles = []
    for pkg in sorted(p for p in SRC.iterdir() if (p / "__init__.py").is_file()):
        graph = {path.stem: _sibling_imports(path) for path in pkg.glob("*.py")}
        circles += [f"{pkg.name}/: " + " -> ".join(c) for c in _cycles(graph)]
    assert not circles, "\n".join(circles)


def test_the_coordinator_imports_no_torch():
    """`frugaltrain coordinator` stays a small process: the CLI and the coordinator import no
    torch, numpy or matplotlib (its model check and its summary run in child processes)."""
    heavy = ("torch", "numpy", "matplotlib", "transformers")
    code = (
        "import sys, frugaltrain.cli, frugaltrain.cluster.coordinator\n"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_the_control_plane_imports_no_torch():
    """No module of cluster/ imports torch, nor a part of frugaltrain other than config, metrics
    and faults: statically (anywhere in a module, inside functions too), and loaded together in
    a fresh interpreter."""
    found = []
    paths = sorted((SRC / "cluster").glob("*.py"))
    for path in paths:
        tree, parts = ast.parse(path.read_text()), []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "frugaltrain":  # `from frugaltrain import processes`
                    names = [f"frugaltrain.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.name} imports {n}" for n in names if n.split(".")[0] == "torch"]
            parts += [n.split(".")[1] for n in names if n.startswith("frugaltrain.")]
        others = set(parts + _imports(tree)) - {"cluster"} - CLUSTER_MAY_IMPORT
        found += [f"{path.name} imports frugaltrain.{p}" for p in sorted(others)]
    assert not found, "\n".join(found)
    modules = ", ".join(f"frugaltrain.cluster.{p.stem}" for p in paths if p.stem != "__init__")
    code = f"import sys, {modules}\nassert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


LAB = SRC.parent.parent / "benchmarks"


def test_the_package_is_apart_from_the_lab():
    """The product is src/frugaltrain/, the lab (benchmarks, result files, measured penalties)
    sits beside it: no product module imports a lab script, and the package ships no data, so
    a measurement never hides in it (the planner reads its penalties from a file it names)."""
    scripts = {p.stem for p in LAB.glob("*.py")} | {"benchmarks"}
    imports = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            imports += [f"{path.relative_to(SRC)} imports {n}" for n in names if n in scripts]
    assert not imports, imports
    data = [p for p in SRC.rglob("*") if p.is_file() and p.suffix != ".py" and "__pycache__"
            not in p.parts]  # fmt: skip
    assert not data, data
    pyproject = tomllib.loads((SRC.parent.parent / "pyproject.toml").read_text())
    assert "package-data" not in pyproject["tool"]["setuptools"]


TESTS = Path(__file__).resolve().parent
MAX_FLAT_TESTS = 6  # the architecture, golden hashes, bad input and top-level modules


def test_tests_mirror_src():
    """Each folder of tests/ is a package of src/frugaltrain/ (comm/ft/ included), the lab's
    benchmarks/, or the shared helpers/ and golden/ data; few test files sit flat."""
    packages = {p.relative_to(SRC) for p in SRC.rglob("__init__.py")}
    packages = {str(p.parent) for p in packages} | {"benchmarks", "helpers", "golden"}
    folders = {
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*")
        if p.is_dir() and "__pycache__" not in p.parts
    }
    assert folders <= packages, sorted(folders - packages)
    flat = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert len(flat) <= MAX_FLAT_TESTS, flat
