"""One Strategy surface: what the Trainer, the loop, the API, the commands and the doctor read
of a strategy (`strategy.X`, `self.strategy.X`, `trainer.strategy.X`, read from the source with
`ast`, nothing imported) is tfbig.distribute.base.Strategy's public surface, whatever backend
or combination of parallelisms runs. A combination adds no method the training layer calls:
the surface only shrinks (SURFACE_SIZE pins it; lower it when a name goes). The one reader
allowed more is the pipeline-stage measurement (tfbig.training.measure builds a pipeline
backend itself to time one stage alone)."""
import ast
import glob
import os

from tfbig.distribute.base import Strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SURFACE_SIZE = 40  # public names of Strategy today (class attributes, methods, properties)
READERS = ("tfbig/training/*.py", "tfbig/api.py", "tfbig/commands/*.py", "tfbig/doctor/*.py")
# tfbig.training.measure times one stage of an in-process pipeline backend it builds itself
MEASURE = {"tfbig/training/measure.py": {"make_stages", "ops", "options", "task"}}


def surface():
    """Strategy's public names, and the attributes its __init__ sets (cfg)."""
    names = {n for n in dir(Strategy) if not n.startswith("_")}
    init = ast.parse(open(os.path.join(ROOT, "tfbig/distribute/base.py")).read())
    for node in ast.walk(init):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            names |= {t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def strategy_reads(path):
    """{attribute name: first line} of every `<...>strategy.NAME` in the file at `path`."""
    found = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        named = (isinstance(owner, ast.Name) and owner.id == "strategy") or (
            isinstance(owner, ast.Attribute) and owner.attr == "strategy")
        if named and not node.attr.startswith("_"):
            found.setdefault(node.attr, node.lineno)
    return found


def test_the_training_layer_reads_only_the_one_strategy_surface():
    names = surface()
    assert len({n for n in names if n != "cfg"}) <= SURFACE_SIZE, sorted(names)
    outside, read = [], set()
    files = sorted(f for pattern in READERS for f in glob.glob(os.path.join(ROOT, pattern)))
    assert len(files) > 20
    for path in files:
        relative = os.path.relpath(path, ROOT)
        allowed = names | MEASURE.get(relative, set())
        for name, line in strategy_reads(path).items():
            read.add(name)
            if name not in allowed:
                outside.append(f"{relative}:{line}: strategy.{name}")
    assert not outside, outside
    # the reader finds what the Trainer uses (a parser that finds nothing passes nothing)
    assert {"make_forward_backward", "apply_gradients", "all_reduce_gradients",
            "build_model", "restore", "is_chief"} <= read


def test_a_name_outside_the_surface_is_found(tmp_path):
    """The check above would catch a backend-specific call (what it guards against)."""
    path = tmp_path / "loop.py"
    path.write_text("def step(trainer):\n"
                    "    trainer.strategy.gather_full(trainer.model.variables)\n"
                    "    return self.strategy._private, strategy.is_chief\n")
    reads = strategy_reads(str(path))
    assert set(reads) == {"gather_full", "is_chief"} and "gather_full" not in surface()
