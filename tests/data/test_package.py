"""tfbig.data is one package with one public surface and no import circle."""

import ast
import os
import subprocess
import sys

import tfbig.data

PACKAGE = os.path.dirname(tfbig.data.__file__)
ROOT = os.path.dirname(os.path.dirname(PACKAGE))


def _tfbig_imports(module: str) -> set[str]:
    """tfbig.data modules that `module` imports (at any depth of its body)."""
    tree = ast.parse(open(os.path.join(PACKAGE, module + ".py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfbig.data"):
            names = [node.module.split(".")[2]] if node.module.count(".") >= 2 else [a.name for a in node.names]
            found.update(names)
    return found


def test_module_imports_form_no_cycle():
    modules = [name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py"]
    graph = {module: _tfbig_imports(module) & set(modules) for module in modules}
    # The ALBERT record builder reads no shard writer (the old albert -> shards -> formats circle).
    assert not graph["albert"] & {"shards", "formats", "prepare", "index"}, graph
    visiting, done = set(), set()

    def visit(module, path):
        assert module not in visiting, f"import cycle: {' -> '.join(path + [module])}"
        if module in done:
            return
        visiting.add(module)
        for target in graph[module]:
            visit(target, path + [module])
        visiting.discard(module)
        done.add(module)

    for module in modules:
        visit(module, [])


def test_public_surface_is_complete_and_preparation_imports_no_tensorflow():
    code = ("import sys, tfbig.data as d; missing = [n for n in d.__all__ if n not in ('make_dataset', "
            "'count_records', 'MAX_PARALLEL_FILES') and not hasattr(d, n)]; "
            "assert not missing, missing; assert 'tensorflow' not in sys.modules, 'prep imported TensorFlow'")
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
    assert callable(tfbig.data.make_dataset) and tfbig.data.count_records.__module__ == "tfbig.data.dataset"
