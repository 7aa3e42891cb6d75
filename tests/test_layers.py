"""The package's structure: every module imports on its own, imports only its own layer or lower ones
(data flows one way: dump → maps → fit → compare / export → attention → model, DESIGN.md §2),
and no two modules import each other, directly or through others.

The import graph is read from the source (``ast``): module-level *and* function-level imports, so
an import deferred into a function to dodge a circle still counts as an edge.
"""

import ast
import fnmatch
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sketchlab"

#: Layers, lowest first. A module may import modules of its own layer or of a lower one.
#: Patterns match dotted module names (a package's ``__init__`` is the package's name).
LAYERS = [
    ("base", ["sketchlab._validation", "sketchlab._version", "sketchlab._threads"]),
    ("primitives", ["sketchlab.polynomial", "sketchlab.scaling", "sketchlab.numerics",
                    "sketchlab.io", "sketchlab.io.*",
                    # the family's interface and where a batch [L, H] meets its heads: what the metrics evaluate
                    "sketchlab.featuremaps.base", "sketchlab.featuremaps.heads"]),
    ("math", ["sketchlab.optimal", "sketchlab.spectral", "sketchlab.objective", "sketchlab.metrics",
              # the LLoPS map itself and what a fit problem is made of (no fitting)
              "sketchlab.llops.maps", "sketchlab.llops.cp",
              "sketchlab.llops._fitting", "sketchlab.llops.sides", "sketchlab.llops.target"]),
    # the baselines' maps (the LLoPS fits start from BASED/PSF), the LLoPS map and the exact Θ forms (as_llops)
    ("baseline maps", ["sketchlab.featuremaps._common", "sketchlab.featuremaps.tensorsketch",
                       "sketchlab.featuremaps.psf_random", "sketchlab.featuremaps.mlp", "sketchlab.featuremaps.elementwise",
                       "sketchlab.featuremaps.based", "sketchlab.featuremaps.llops", "sketchlab.featuremaps.to_llops"]),
    ("llops fits", ["sketchlab.llops", "sketchlab.llops.*"]),  # inits from BASED/PSF: above the baseline maps
    # the feature-map family: maps, a fitted sketch as a map, the name registry (fit reads it)
    ("feature maps", ["sketchlab.featuremaps", "sketchlab.featuremaps.*"]),
    ("fit", ["sketchlab.fit", "sketchlab.export"]),            # Fit.save_theta writes through export
    ("dump tools", ["sketchlab._dumpsel", "sketchlab.compare", "sketchlab.verify", "sketchlab.advise",
                    "sketchlab.spectrum", "sketchlab.plots"]),
    ("attention", ["sketchlab.attention", "sketchlab.attention.*"]),
    # what capture and conversion share about transformers models (the family table, loaders, interfaces)
    ("transformers", ["sketchlab.hf", "sketchlab.hf.*"]),
    ("model", ["sketchlab.tasks", "sketchlab.tasks.*", "sketchlab.capture", "sketchlab.convert",
               "sketchlab.convert.*", "sketchlab.evaluate"]),
    ("applications", ["sketchlab.cli", "sketchlab.cli.*", "sketchlab.demo", "sketchlab.__main__"]),
    ("package", ["sketchlab"]),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> int:
    """Index of the most specific layer pattern matching ``module`` (an exact name beats a ``*``)."""
    exact = [i for i, (_, pats) in enumerate(LAYERS) if module in pats]
    if exact:
        return exact[0]
    wild = [i for i, (_, pats) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, p) for p in pats if "*" in p)]
    if not wild:
        raise AssertionError(f"module {module} is in no layer of tests/test_layers.py LAYERS: add it")
    return wild[0]


def imports_of(module: str) -> set[str]:
    """sketchlab modules ``module`` imports anywhere in its source (resolved to the defining module
    when ``from pkg import name`` names a submodule, to the package otherwise)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            if not name.startswith("sketchlab"):
                continue
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                out.add(sub if sub in MODULES else name)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("sketchlab"))
    out.discard(module)
    return {m for m in out if m in MODULES}


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_go_down_the_layers():
    upward = [
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
        for m, deps in GRAPH.items() for dep in sorted(deps) if layer_of(dep) > layer_of(m)
    ]
    assert not upward, "imports against the data flow:\n" + "\n".join(upward)


def test_capture_imports_nothing_of_conversion():
    """Capture → fit → convert: capture shares only ``sketchlab.hf`` with conversion, below both."""
    assert not {d for d in GRAPH["sketchlab.capture"] if d.startswith("sketchlab.convert")}
    assert {"sketchlab.hf.families", "sketchlab.hf.interface"} <= GRAPH["sketchlab.capture"]


#: What the mechanisms' operations (``attention/ops/``, one folder per mechanism, DESIGN §2) may import of the
#: attention layer around them: the argument checks and the state types, nothing that chooses among them.
OPS_MAY_IMPORT = {"sketchlab.attention._checks", "sketchlab.attention.state", "sketchlab.attention.memory_state"}


def _ops_upward(graph) -> list[str]:
    return [f"{m} imports {dep}" for m, deps in graph.items() if m.startswith("sketchlab.attention.ops")
            for dep in sorted(deps) if dep.startswith("sketchlab.attention") and dep != "sketchlab.attention"
            and not dep.startswith("sketchlab.attention.ops") and dep not in OPS_MAY_IMPORT]


def test_ops_sit_below_the_attention_entry_points():
    """``attention/ops/`` holds each mechanism's naive, chunk and recurrent forms; the entry points, the modules
    and the options above choose among them, so ops/ never imports them (only the checks and the state types):
    checked on the graph, and on the graph with one such import planted."""
    assert any(m.startswith("sketchlab.attention.ops.") for m in GRAPH)
    assert not _ops_upward(GRAPH), "attention/ops/ imports the layer above it:\n" + "\n".join(_ops_upward(GRAPH))
    planted = {**GRAPH, "sketchlab.attention.ops.hybrid": GRAPH["sketchlab.attention.ops.hybrid"]
               | {"sketchlab.attention.functional"}}
    assert _ops_upward(planted) == ["sketchlab.attention.ops.hybrid imports sketchlab.attention.functional"]


def _cycle() -> list[str] | None:
    """One import cycle of GRAPH (a list of modules, first = last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for dep in sorted(GRAPH[m]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_a_circle_and_an_upward_import():
    """The two structure checks fail on a circle the layering forbids (metrics -> attention.errors -> metrics, the
    second edge a relative import): guards that the graph reader resolves relative, deferred imports."""
    saved = {m: set(GRAPH[m]) for m in ("sketchlab.metrics",)}
    try:
        GRAPH["sketchlab.metrics"].add("sketchlab.attention.errors")
        assert _cycle() is not None
        with pytest.raises(AssertionError, match="sketchlab.metrics .math. imports sketchlab.attention.errors"):
            test_imports_go_down_the_layers()
    finally:
        GRAPH.update(saved)
    assert "sketchlab.featuremaps.based" in GRAPH["sketchlab.llops.inits"]  # a deferred import in a function is read


def test_every_module_imports_in_isolation():
    """Each module imported first in a clean interpreter state (sketchlab.* removed from
    sys.modules between modules; one subprocess so torch is imported once). Importing any
    ``sketchlab.X`` runs ``sketchlab/__init__`` first, so the modules that ``import sketchlab``
    loads all see exactly the import order of one clean ``import sketchlab``: that import stands
    for them, and every other module gets its own clean import. ``__main__`` modules run a program
    when imported and are left out."""
    script = (
        "import importlib, sys, traceback\n"
        "import torch\n"
        "def clean():\n"
        "    for key in [k for k in sys.modules if k == 'sketchlab' or k.startswith('sketchlab.')]:\n"
        "        del sys.modules[key]\n"
        "bad = []\n"
        "clean()\n"
        "import sketchlab\n"
        "loaded = {k for k in sys.modules if k == 'sketchlab' or k.startswith('sketchlab.')}\n"
        f"names = {sorted(m for m in MODULES if not m.endswith('.__main__'))!r}\n"
        "for name in [n for n in names if n not in loaded]:\n"
        "    clean()\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        bad.append(name + ': ' + traceback.format_exc(limit=3))\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout + run.stderr
