"""The package's shape, checked from its source (AST): layers, cycles, and who may change what.

- Layers: config/options/errors/kernels/runtime -> models -> loading -> pipeline -> server, demo,
  testing, export -> benchmarks -> cli (and the package root). A module imports only from its own layer or
  lower ones, function-level imports included, and the import graph has no cycle.
- No module outside `qwenfast/pipeline/` assigns attributes on a pipeline object (they change it
  through `pipe.configure(...)` and its methods), and no code replaces a module's `forward`.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "qwenfast"

LAYER_OF = {  # top-level name under qwenfast/ -> layer
    "about": 0, "errors": 0, "options": 0, "validation": 0, "config": 0, "kernels": 0, "runtime": 0,
    "models": 1, "loading": 2, "pipeline": 3,
    "server": 4, "demo": 4, "testing": 4, "export": 4,
    "benchmarks": 5,
    "launch": 4,  # process spawning for --parallel: the CLI and `serve --parallel` use it
    "engine_args": 4,  # the engine switches' argparse group: the CLI and the server use it
    "cli": 6, "cli_common": 6, "cli_tasks": 6, "cli_tools": 6, "__init__": 6, "__main__": 6, "assets": 0,
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


# ------------------------------------------------------------------------------------------- written contracts
# The layers talk through written contracts: the pipeline asks a model only what
# `runtime/contract.py` states, the kernels know no model's layer names (a model names its own FP8
# Linears), options.py stands on the standard library alone, and one name is one table.


def _is_transformer(expr: ast.expr) -> bool:
    """`tr`, `transformer`, `self.transformer`, `pipe.transformer`, ...: the model a pipeline denoises with."""
    return (isinstance(expr, ast.Name) and expr.id in ("tr", "transformer")) or (
        isinstance(expr, ast.Attribute) and expr.attr == "transformer"
    )


def test_the_pipeline_asks_the_transformer_only_through_its_contract():
    """No `hasattr`/`getattr`/`setattr` on the transformer and no attribute assigned on it in pipeline/
    or runtime/: what a model has is `runtime.contract.DenoisableTransformer`, set through its methods."""
    bad = []
    for mod, _f, tree in _walk_package():
        if not mod.startswith(("qwenfast.pipeline", "qwenfast.runtime")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and _is_transformer(
                    node.args[0]) and node.func.id in ("hasattr", "getattr", "setattr", "delattr"):  # fmt: skip
                bad.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                bad += [f"{mod}:{node.lineno} sets {ast.unparse(t)}" for t in _targets(node)
                        if isinstance(t, ast.Attribute) and _is_transformer(t.value)]  # fmt: skip
    assert not bad, "probes or attribute writes on the transformer (use runtime/contract.py's members):\n" + "\n".join(bad)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _model_layer_names() -> set[str]:
    """The models' layer names: every `self.<name> = <Module>(...)` in models/ with an underscore in the
    name (`attn`, `norm1` are too common a word to flag), and diffusers' separate Q/K/V names."""
    names = {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}
    for mod, _f, tree in _walk_package():
        if not mod.startswith("qwenfast.models."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                fn = node.value.func
                ctor = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                names.update(t.attr for t in node.targets if ctor[:1].isupper() and isinstance(t, ast.Attribute)
                             and isinstance(t.value, ast.Name) and t.value.id == "self" and "_" in t.attr
                             and not t.attr.startswith("_"))  # fmt: skip
    return names


def test_kernels_know_no_model_layer_names():
    """kernels/ is below the models: its code (names, attributes, strings; docstrings are prose) names no
    model's layers. The FP8 walker takes the model's own list (`fp8_linears()`)."""
    names = _model_layer_names()
    assert {"transformer_blocks", "to_qkv", "img_mlp", "img_mod"} <= names  # the collector sees the models
    bad = []
    for mod, _f, tree in _walk_package():
        if not mod.startswith("qwenfast.kernels"):
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                words = [node.attr]
            elif isinstance(node, ast.Name):
                words = [node.id]
            elif isinstance(node, (ast.arg, ast.keyword)):
                words = [node.arg or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                words = re.findall(r"\w+", node.value)
            else:
                continue
            if names.intersection(words):
                bad.append(f"{mod}:{node.lineno} {sorted(names.intersection(words))}")
    assert not bad, "model layer names in kernels/ (let the model name them):\n" + "\n".join(bad)


def test_options_imports_only_errors_and_the_standard_library():
    """options.py is below everything: it imports `errors` and the standard library, nothing else (no
    runtime module inside a validation, no argparse group: that is engine_args.py)."""
    f = MODULES["qwenfast.options"]
    bad = []
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.ImportFrom) and node.level:
            if not (node.level == 1 and node.module == "errors"):
                bad.append(f"{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            tops = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else [
                (node.module or "").split(".")[0]]  # fmt: skip
            bad += [f"{node.lineno}: {t}" for t in tops if t not in sys.stdlib_module_names and t != "__future__"]
    assert not bad, "options.py imports beyond errors and the standard library:\n" + "\n".join(bad)


ENGINE = max(LAYER_OF[n] for n in ("config", "runtime", "models", "loading", "pipeline"))


def _tables(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of module-level UPPER_CASE names bound to a dict, list, tuple or set (literal or comprehension)."""
    kinds = (ast.Dict, ast.List, ast.Tuple, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    out = []
    for node in tree.body:
        pairs = [(t, node.value) for t in node.targets] if isinstance(node, ast.Assign) else (
            [(node.target, node.value)] if isinstance(node, ast.AnnAssign) and node.value is not None else [])  # fmt: skip
        out += [(t.id, node.lineno) for t, v in pairs
                if isinstance(t, ast.Name) and t.id.isupper() and not t.id.startswith("__") and isinstance(v, kinds)]  # fmt: skip
    return out


def test_one_name_is_one_table():
    """No two module-level tables of the engine (config .. pipeline, what every front end reads) share a
    name: `PRESETS` is the sampling presets, `CACHE_PRESETS` the step-cache policies."""
    where: dict[str, list[str]] = {}
    for mod, _f, tree in _walk_package():
        parts = mod.split(".")  # a module with no layer yet is test_every_module_has_a_layer's to flag
        if LAYER_OF.get(parts[1] if len(parts) > 1 else "__init__", ENGINE + 1) <= ENGINE:
            for name, line in _tables(tree):
                where.setdefault(name, []).append(f"{mod}:{line}")
    bad = {n: w for n, w in where.items() if len(w) > 1}
    assert not bad, "one name, several tables:\n" + "\n".join(f"{n}: {', '.join(w)}" for n, w in sorted(bad.items()))


@pytest.mark.parametrize("check,planted", [
    (test_the_pipeline_asks_the_transformer_only_through_its_contract,
     ("pipeline/planted.py", "def f(self):\n    return hasattr(self.transformer, 'modulation_table')\n")),
    (test_the_pipeline_asks_the_transformer_only_through_its_contract,
     ("pipeline/planted.py", "def f(self, tr):\n    tr.fused = False\n")),
    (test_kernels_know_no_model_layer_names, ("kernels/planted.py", "def f(model):\n    return model.transformer_blocks\n")),
    (test_kernels_know_no_model_layer_names, ("kernels/planted.py", "NAMES = ('attn.to_qkv', 'img_mlp.net.2')\n")),
    (test_options_imports_only_errors_and_the_standard_library, ("options.py", "from .runtime import cache\n")),
    (test_options_imports_only_errors_and_the_standard_library, ("options.py", "import torch\n")),
    (test_one_name_is_one_table, ("runtime/planted.py", "PRESETS = {'fast': 1}\n")),
])  # fmt: skip
def test_the_contract_checks_can_fail(check, planted, monkeypatch):
    """Each contract check flags a planted violation (a module of a temporary tree, or options.py replaced)."""
    path = PKG / planted[0]
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: planted[1] if self == path else real_read(self, *a, **k))
    monkeypatch.setitem(MODULES, "qwenfast." + planted[0][:-3].replace("/", "."), path)
    with pytest.raises(AssertionError):
        check()


# ------------------------------------------------------------------------------------------- one registry
# What a model folder can do is decided once: each pipeline class declares it (`CAPABILITIES`,
# pipeline/tasks.py), `pipeline/auto.py` lists the classes, and the front ends load through it and read
# the declarations. They keep no model-kind table and probe no pipeline.


def _front_end(mod: str) -> bool:
    parts = mod.split(".")
    return len(parts) > 1 and (parts[1].startswith("cli") or parts[1] == "server")


def _names_a_pipeline(expr: ast.expr) -> bool:
    """`pipe`, `self.pipe`, `self._pipe`, `pipeline`, ...: a pipeline object (by the front ends' naming)."""
    return "pipe" in ast.unparse(expr).lower()


def test_front_ends_do_not_decide_what_a_model_can_do():
    """cli*.py and server/: no reading of `model_index.json` or its `_class_name`, no pipeline class
    imported or tested with `isinstance`, no `hasattr` / defaulted `getattr` on a pipeline. They load
    through `pipeline.auto` and read `pipe.capabilities`."""
    bad = []
    for mod, _f, tree in _walk_package():
        if not _front_end(mod):
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            where = f"{mod}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and (
                    "model_index.json" in node.value or "_class_name" in node.value):  # fmt: skip
                bad.append(f"{where} reads the folder's kind ({node.value[:40]!r})")
            elif isinstance(node, ast.ImportFrom) and "pipeline" in (node.module or "").split("."):
                bad += [f"{where} imports {a.name}" for a in node.names if a.name.endswith("Pipeline")]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                fn, args = node.func.id, node.args
                if fn == "isinstance" and len(args) == 2 and ("Pipeline" in ast.unparse(args[1])
                                                              or ast.unparse(args[1]).endswith("_cls")):  # fmt: skip
                    bad.append(f"{where} {ast.unparse(node)}")
                if (fn == "hasattr" or (fn == "getattr" and len(args) == 3)) and _names_a_pipeline(args[0]):
                    bad.append(f"{where} {ast.unparse(node)}")
    assert not bad, "model-kind decisions in the front ends (ask pipeline.auto, read pipe.capabilities):\n" + \
        "\n".join(bad)


def test_for_task_shares_one_state_object_not_a_dict():
    """No code in pipeline/ assigns an object's `__dict__`: `for_task` gives a thin object over the loaded
    model's `ModelState` (pipeline/state.py), not a second class over the same dictionary."""
    bad = []
    for mod, _f, tree in _walk_package():
        if not mod.startswith("qwenfast.pipeline"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                bad += [f"{mod}:{node.lineno} {ast.unparse(t)}" for t in _targets(node)
                        if isinstance(t, ast.Attribute) and t.attr == "__dict__"]  # fmt: skip
    assert not bad, "__dict__ assigned (share a ModelState instead):\n" + "\n".join(bad)


def _class_defs() -> dict[str, ast.ClassDef]:
    return {n.name: n for mod, _f, tree in _walk_package() if mod.startswith("qwenfast.pipeline")
            for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}  # fmt: skip


def test_every_registered_pipeline_declares_its_capabilities():
    """Every class in `pipeline/auto.py`'s `PIPELINES` assigns `CAPABILITIES = Capabilities(...)` in its own
    body (a subclass runs other tasks than its base: it declares them, it does not inherit them)."""
    tree = ast.parse(MODULES["qwenfast.pipeline.auto"].read_text())
    listed = [ast.unparse(e) for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PIPELINES"
              for e in n.value.elts]  # fmt: skip
    assert len(listed) >= 9, listed  # the registry is where this test looks
    classes, bad = _class_defs(), []
    for name in listed:
        body = classes[name].body if name in classes else []
        declared = [n for n in body if isinstance(n, (ast.Assign, ast.AnnAssign)) and "CAPABILITIES" in
                    [ast.unparse(t) for t in _targets(n)] and isinstance(n.value, ast.Call)
                    and ast.unparse(n.value.func) == "Capabilities"]  # fmt: skip
        if not declared:
            bad.append(name)
    assert not bad, "registered pipeline classes without their own `CAPABILITIES = Capabilities(...)`: " + ", ".join(bad)


@pytest.mark.parametrize("check,planted", [
    (test_front_ends_do_not_decide_what_a_model_can_do,
     ("cli_planted.py", "import json\ndef f(m):\n    return json.load(open(m + '/model_index.json'))\n")),
    (test_front_ends_do_not_decide_what_a_model_can_do,
     ("server/planted.py", "KINDS = {'QwenImagePipeline': 't2i'}\ndef f(d):\n    return KINDS[d['_class_name']]\n")),
    (test_front_ends_do_not_decide_what_a_model_can_do,
     ("server/planted.py", "from ..pipeline.edit import QwenImageEditPipeline\n")),
    (test_front_ends_do_not_decide_what_a_model_can_do,
     ("server/planted.py", "def f(pipe, edit_cls):\n    return isinstance(pipe, edit_cls)\n")),
    (test_front_ends_do_not_decide_what_a_model_can_do,
     ("cli_planted.py", "def f(self):\n    return hasattr(self.pipe, 'for_task')\n")),
    (test_front_ends_do_not_decide_what_a_model_can_do,
     ("server/planted.py", "def f(pipe):\n    return getattr(pipe, 'mode', None)\n")),
    (test_for_task_shares_one_state_object_not_a_dict,
     ("pipeline/planted.py", "def for_task(pipe, cls):\n    v = cls.__new__(cls)\n    v.__dict__ = pipe.__dict__\n")),
    (test_every_registered_pipeline_declares_its_capabilities,
     ("pipeline/auto.py", "PIPELINES = (A, B, C, D, E, F, G, H, QwenImagePipeline)\n")),
])  # fmt: skip
def test_the_registry_checks_can_fail(check, planted, monkeypatch):
    """Each registry check flags a planted violation (a module of a temporary tree, or auto.py replaced)."""
    path = PKG / planted[0]
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: planted[1] if self == path else real_read(self, *a, **k))
    monkeypatch.setitem(MODULES, "qwenfast." + planted[0][:-3].replace("/", "."), path)
    with pytest.raises(AssertionError):
        check()


def test_the_formatter_lays_out_the_package():
    """`ruff format` owns the layout: the package is formatted, and `# fmt: skip` is kept for data tables
    (module-level constants) only, a handful of them."""
    import shutil
    import subprocess

    markers = [f"{f.relative_to(PKG.parent)}:{n}" for f in PKG.rglob("*.py")
               for n, line in enumerate(f.read_text().splitlines(), 1) if "fmt: skip" in line]  # fmt: skip
    assert len(markers) <= 40, markers
    ruff = shutil.which("ruff")
    if ruff is None:  # the [test] extra installs ruff; CI must have it
        pytest.fail("ruff is not installed (pip install -e '.[test]')")
    r = subprocess.run([ruff, "format", "--check", str(PKG)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_spelling_per_model_family():
    """Qwen-Image-2.1's modules are named `<component>21` in every layer (no second spelling)."""
    names = {f.stem for f in PKG.rglob("*.py")}
    assert not {n for n in names if n.startswith("qwenimage21")}, sorted(n for n in names if "21" in n)
    assert {"transformer21", "vae21", "pipeline21", "folder21"} <= names
