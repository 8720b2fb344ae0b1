"""The package's shape, checked from its source (AST): layers, cycles, and who may change what.

- Layers: config/options/errors/kernels/runtime -> models -> loading -> pipeline -> server, demo,
  testing, export -> benchmarks -> cli (and the package root). A module imports only from its own layer or
  lower ones, function-level imports included, and the import graph has no cycle.
- No module outside `qwenfast/pipeline/` assigns attributes on a pipeline object (they change it
  through `pipe.configure(...)` and its methods), and no code replaces a module's `forward`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "qwenfast"

LAYER_OF = {  # top-level name under qwenfast/ -> layer
    "errors": 0, "options": 0, "validation": 0, "config": 0, "kernels": 0, "runtime": 0,
    "models": 1, "loading": 2, "pipeline": 3,
    "server": 4, "demo": 4, "testing": 4, "export": 4,
    "benchmarks": 5,
    "launch": 4,  # process spawning for --parallel: the CLI and `serve --parallel` use it
    "cli": 6, "cli_tasks": 6, "cli_tools": 6, "__init__": 6, "__main__": 6, "assets": 0,
}  # fmt: skip
NAMES = {0: "config/options/errors/validation/kernels/runtime", 1: "models", 2: "loading", 3: "pipeline",
         4: "server/demo/testing/export/launch", 5: "benchmarks", 6: "cli"}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """Target qwenfast modules of one import statement."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "qwenfast"]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    if prefix.split(".")[0] != "qwenfast":
        return []
    out = []
    for a in node.names:
        sub = f"{prefix}.{a.name}"
        out.append(sub if sub in MODULES else prefix)
    return out


def _layer(mod: str) -> int:
    parts = mod.split(".")
    return LAYER_OF["__init__"] if len(parts) == 1 else LAYER_OF[parts[1]]


def _graph() -> dict[str, set[str]]:
    g = {}
    for mod, f in MODULES.items():
        tree = ast.parse(f.read_text(), str(f))
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(t for t in _resolve(mod, f.name == "__init__.py", node) if t in MODULES and t != mod)
        g[mod] = deps
    return g


def test_every_module_has_a_layer():
    assert not [m for m in MODULES if len(m.split(".")) > 1 and m.split(".")[1] not in LAYER_OF]


def test_imports_follow_the_layers():
    bad = []
    for mod, deps in _graph().items():
        for d in deps:
            if _layer(d) > _layer(mod):
                bad.append(f"{mod} ({NAMES[_layer(mod)]}) imports {d} ({NAMES[_layer(d)]})")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = _graph()
    # packages import their own submodules' names lazily; a package and its children are one unit
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


PIPE_NAMES = {"pipe", "pipeline", "epipe"}


def _is_pipe(expr: ast.expr) -> bool:
    return (isinstance(expr, ast.Name) and expr.id in PIPE_NAMES) or (
        isinstance(expr, ast.Attribute) and expr.attr in PIPE_NAMES
    )


def _targets(node) -> list[ast.expr]:
    ts = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for t in ts:
        out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
    return out


def _walk_package():
    for mod, f in MODULES.items():
        yield mod, f, ast.parse(f.read_text(), str(f))


def test_nothing_outside_pipeline_sets_attributes_on_a_pipeline():
    bad = []
    for mod, _f, tree in _walk_package():
        if mod.startswith("qwenfast.pipeline"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in _targets(node):
                    if isinstance(t, ast.Attribute) and _is_pipe(t.value):
                        bad.append(f"{mod}:{node.lineno} sets {ast.unparse(t)}")
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and _is_pipe(t.value.value) \
                            and t.value.attr == "__dict__":  # fmt: skip
                        bad.append(f"{mod}:{node.lineno} writes {ast.unparse(t)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
                if node.args and _is_pipe(node.args[0]):
                    bad.append(f"{mod}:{node.lineno} {node.func.id} on {ast.unparse(node.args[0])}")
    assert not bad, "outside qwenfast/pipeline, use pipe.configure(...) or a method:\n" + "\n".join(bad)


def test_no_code_replaces_a_modules_forward():
    bad = []
    for mod, _f, tree in _walk_package():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                bad += [f"{mod}:{node.lineno} {ast.unparse(t)}" for t in _targets(node)
                        if isinstance(t, ast.Attribute) and t.attr in ("forward", "forward_fused")]  # fmt: skip
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                name = node.args[1] if len(node.args) > 1 else None
                if isinstance(name, ast.Constant) and name.value in ("forward", "forward_fused"):
                    bad.append(f"{mod}:{node.lineno} setattr(..., {name.value!r})")
                if isinstance(name, ast.Name) and name.id == "attr":  # the old offload's loop over forward names
                    bad.append(f"{mod}:{node.lineno} setattr(..., attr)")
    assert not bad, "replaced forwards (use a block runner or PyTorch hooks):\n" + "\n".join(bad)


@pytest.mark.parametrize("check", [test_imports_follow_the_layers, test_no_import_cycles,
                                   test_nothing_outside_pipeline_sets_attributes_on_a_pipeline,
                                   test_no_code_replaces_a_modules_forward])  # fmt: skip
def test_the_checks_can_fail(check, monkeypatch, tmp_path):
    """Each check flags a planted violation (a module in a temporary copy of the tree)."""
    planted = {
        test_imports_follow_the_layers: ("models/planted.py", "from ..pipeline import sampling\n"),
        test_no_import_cycles: ("runtime/planted.py", "from . import planted2\n"),
        test_nothing_outside_pipeline_sets_attributes_on_a_pipeline: ("server/planted.py", "def f(pipe):\n    pipe.cuda_graphs = False\n"),
        test_no_code_replaces_a_modules_forward: ("runtime/planted.py", "def f(block, g):\n    block.forward = g\n"),
    }[check]  # fmt: skip
    extra = {}
    path = PKG / planted[0]
    extra["qwenfast." + planted[0][:-3].replace("/", ".")] = (path, planted[1])
    if check is test_no_import_cycles:
        extra["qwenfast.runtime.planted2"] = (PKG / "runtime/planted2.py", "from . import planted\n")
    real_read = Path.read_text
    files = {p: src for p, src in extra.values()}
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: files[self] if self in files else real_read(self, *a, **k))
    for m, (p, _) in extra.items():
        monkeypatch.setitem(MODULES, m, p)
    with pytest.raises(AssertionError):
        check()
