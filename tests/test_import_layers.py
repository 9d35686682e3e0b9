"""Imports inside tfbig/ run one way: down the layer map of tfbig/__init__.py, never in a circle.

Pure `ast`: nothing is imported (no TensorFlow), so the whole check takes well under a second.
Every import counts, at the top of a module or inside a function: `import a.b`, `from a import b`
(the module a.b when there is one, else a), relative imports, `importlib.import_module("a.b")`
and a registry's "a.b:Name" string.
"""
import ast
import fnmatch
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEAVES = ("launch", "data_prep", "notebooks", "benchmarks", "tests")
REGISTRY_ENTRY = re.compile(r"^(tfbig(?:\.\w+)+):\w+$")


# ---- reading a package ----------------------------------------------------------------------
def package_modules(root):
    """{dotted module name: path} of every .py file under root/tfbig (a package: its name)."""
    modules = {}
    for path in sorted((root / "tfbig").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def layer_map(root):
    """[(layer, [pattern, ...])], lowest first, from the 'Lowest first:' table of the package
    docstring of root/tfbig/__init__.py."""
    doc = ast.get_docstring(ast.parse((root / "tfbig" / "__init__.py").read_text()))
    table = doc.split("Lowest first:", 1)[1].strip("\n").split("\n\n", 1)[0]
    layers = []
    for line in table.splitlines():
        name, colon, rest = line.strip().partition(":")
        if colon and " " not in name:
            layers.append((name, rest.split()))
        else:
            layers[-1][1].extend(line.split())
    return layers


def layer_of(module, layers):
    """(index, name) of the layer whose longest pattern names `module`, or None."""
    best = None
    for index, (name, patterns) in enumerate(layers):
        for pattern in patterns:
            names = fnmatch.fnmatchcase(module, pattern) or (
                "*" not in pattern and "." in pattern and module.startswith(pattern + "."))
            if names and (best is None or len(pattern) > best[0]):
                best = (len(pattern), index, name)
    return None if best is None else best[1:]


def _resolve(name, modules):
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=None)
def _parse(path):
    return ast.parse(path.read_text(), str(path))


def imports(module, path, modules, top_level_only=False):
    """[(line, imported name)] of every import statement in `path` (module `module`)."""
    tree = _parse(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:  # a submodule if there is one, else the package itself
                found.append((node.lineno, f"{base}.{alias.name}"
                              if f"{base}.{alias.name}" in modules else base))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) == "import_module" and node.args and isinstance(
                node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            entry = REGISTRY_ENTRY.match(node.value)
            if entry:
                found.append((node.lineno, entry.group(1)))
    return found


def import_graph(root):
    """{module: {imported tfbig module: (path, line)}}, a module's own package excluded."""
    modules = package_modules(root)
    graph = {}
    for module, path in modules.items():
        edges = {}
        for line, name in imports(module, path, modules):
            target = _resolve(name, modules) if name.split(".")[0] == "tfbig" else None
            if target and target not in (module, "tfbig"):
                edges.setdefault(target, (path.relative_to(root), line))
        graph[module] = edges
    return graph


def circles(graph):
    """Every import circle: the strongly connected components of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_problems(root):
    """Sentences naming every unmapped module and every import pointing up the layer map."""
    layers, graph = layer_map(root), import_graph(root)
    order = " -> ".join(name for name, _ in layers)
    problems = [f"{module} is in no layer: add it (or a pattern naming it) to the map in "
                f"tfbig/__init__.py ({order})" for module in graph if layer_of(module, layers)
                is None]
    for module, edges in graph.items():
        here = layer_of(module, layers)
        for target, (path, line) in sorted(edges.items()):
            there = layer_of(target, layers)
            if here and there and there[0] > here[0]:
                problems.append(f"{path}:{line}: {module} (layer {here[1]}) imports {target} "
                                f"(layer {there[1]}, above it); imports point down {order}")
    return problems


def circle_problems(root):
    graph = import_graph(root)
    out = []
    for component in circles(graph):
        inside = set(component)
        edges = [f"{m} -> {t} ({p}:{n})" for m in component
                 for t, (p, n) in sorted(graph[m].items()) if t in inside]
        out.append("import circle among " + ", ".join(component) + ": " + "; ".join(edges))
    return out


# ---- tfbig itself -----------------------------------------------------------------------------
def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    problems = layer_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_the_map_names_folders_not_modules_inside_them():
    """A folder is one layer: the map lists packages and the modules at the top of tfbig/,
    never a module inside a folder (an exception that says the folder is in the wrong place)."""
    inside = [pattern for _, patterns in layer_map(ROOT) for pattern in patterns
              if pattern.count(".") > 1 or (pattern.count(".") == 1 and not (
                  (ROOT / pattern.replace(".", "/")).is_dir()
                  or (ROOT / (pattern.replace(".", "/") + ".py")).is_file()))]
    assert not inside, f"modules inside a folder in the layer map: {inside}"


def test_the_package_keeps_few_top_level_modules_and_short_files():
    """tfbig/ opens on its folders: at most 12 modules at its top; no library file over 400
    lines (a longer one holds two jobs)."""
    top = sorted(p.name for p in (ROOT / "tfbig").glob("*.py"))
    assert len(top) <= 12, top
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "tfbig").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"library files over 400 lines: {long}"


def _is_class_name(node):
    """`type(x).__name__` or `x.__class__.__name__`."""
    return isinstance(node, ast.Attribute) and node.attr == "__name__" and (
        (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "type")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "__class__"))


def class_name_lookups(path):
    """[line] where `path` looks something up by a class's name: `table[type(m).__name__]`,
    `table.get(type(m).__name__)`, `type(m).__name__ in table`."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Subscript) and _is_class_name(node.slice):
            found.append(node.lineno)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get"
              and node.args and _is_class_name(node.args[0])):
            found.append(node.lineno)
        elif (isinstance(node, ast.Compare) and _is_class_name(node.left)
              and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)):
            found.append(node.lineno)
    return found


def test_no_module_looks_a_layout_up_by_class_name():
    """A model declares how it may be split next to itself (its `layout()`,
    tfbig.models.layout); no backend keeps a table keyed by model class names."""
    found = [f"{path.relative_to(ROOT)}:{line}" for path in package_modules(ROOT).values()
             for line in class_name_lookups(path)]
    assert not found, f"looked up by class name: {found}"


def test_the_class_name_check_finds_each_form(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(m):\n    a = PLANS[type(m).__name__]\n"
                    "    b = PLANS.get(type(m).__name__)\n"
                    "    return m.__class__.__name__ in LOCAL, a, b, type(m).__name__ == 'x'\n")
    assert class_name_lookups(path) == [2, 3, 4]


def test_no_import_circle_inside_tfbig():
    problems = circle_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_a_package_init_runs_nothing_above_its_lowest_module():
    """Importing a.b runs a/__init__.py first: its top-level imports sit at or below every
    module of the package (else importing a low module pulls a higher one in)."""
    layers, modules = layer_map(ROOT), package_modules(ROOT)
    problems = []
    for package, path in modules.items():
        if path.name != "__init__.py":
            continue
        members = [layer_of(m, layers) for m in modules if m.startswith(package + ".")]
        members = [m for m in members if m is not None]
        lowest = min(members, default=layer_of(package, layers))
        for line, name in imports(package, path, modules, top_level_only=True):
            target = _resolve(name, modules) if name.startswith("tfbig.") else None
            there = layer_of(target, layers) if target else None
            if there and there[0] > lowest[0]:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {target} (layer "
                                f"{there[1]}) at the top, above its module in layer {lowest[1]}")
    assert not problems, "\n".join(problems)


def test_tfbig_imports_no_leaf():
    modules = package_modules(ROOT)
    found = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
             for module, path in modules.items() for line, name in imports(module, path, modules)
             if name.split(".")[0] in LEAVES]
    assert not found, "tfbig imports no leaf (" + ", ".join(LEAVES) + "):\n" + "\n".join(found)


def test_new_task_modules_fit_the_map_without_an_edit():
    """Fine-tuning tasks (tasks/squad.py, tasks/classify.py) sit in the tasks layer, above the
    helpers they read (SQuAD features/post-processing/evaluation, GLUE, pretrained weights)."""
    layers = layer_map(ROOT)
    for name in ("tfbig.tasks.squad", "tfbig.tasks.classify"):
        assert layer_of(name, layers)[1] == "tasks"
    for helper in ("tfbig.data.squad.features", "tfbig.data.squad.postprocess", "tfbig.data.squad.evaluate",
                   "tfbig.data.glue", "tfbig.convert.init_checkpoint", "tfbig.convert.run_dir", "tfbig.data",
                   "tfbig.models.bert"):
        assert layer_of(helper, layers)[0] < layer_of("tfbig.tasks.squad", layers)[0], helper


# ---- the checker catches what it must --------------------------------------------------------
MAP = '''"""Layers. Lowest first:

    low:   tfbig tfbig.low
    high:  tfbig.high tfbig.pkg
"""
'''


def a_package(tmp_path, files):
    for name, text in {"tfbig/__init__.py": MAP, **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_check_finds_an_upward_import_inside_a_function_and_a_circle(tmp_path):
    root = a_package(tmp_path, {
        "tfbig/low.py": "def f():\n    from tfbig.high import g\n",
        "tfbig/high.py": "from tfbig import low\n\ndef g():\n    from . import pkg\n",
        "tfbig/pkg/__init__.py": "import importlib\nX = {'a': 'tfbig.high:g'}\n",
    })
    assert layer_problems(root) == [
        "tfbig/low.py:2: tfbig.low (layer low) imports tfbig.high (layer high, above it); "
        "imports point down low -> high"]
    (problem,) = circle_problems(root)  # high -> pkg (relative) -> high (a registry string)
    assert problem.startswith("import circle among tfbig.high, tfbig.low, tfbig.pkg")


def test_a_clean_package_passes_and_an_unmapped_module_is_named(tmp_path):
    root = a_package(tmp_path, {"tfbig/high.py": "import tfbig.low\n", "tfbig/low.py": "",
                                "tfbig/stray.py": "importlib.import_module('tfbig.low')\n"})
    assert circle_problems(root) == []
    assert layer_problems(root) == [
        "tfbig.stray is in no layer: add it (or a pattern naming it) to the map in "
        "tfbig/__init__.py (low -> high)"]


@pytest.mark.parametrize("module, layer", [("tfbig.training.registry", "training"),
                                           ("tfbig.distribute", "backends"),
                                           ("tfbig.distribute.zero", "backends"),
                                           ("tfbig.commands.squad", "commands"),
                                           ("tfbig.data.squad.features", "inputs"),
                                           ("tfbig.training.local_plan", "training"),
                                           ("tfbig", "api"), ("tfbig.api", "api"),
                                           ("tfbig.tasks.user", "tasks"),
                                           ("tfbig.compat", "base")])
def test_the_longest_pattern_wins(module, layer):
    assert layer_of(module, layer_map(ROOT))[1] == layer
