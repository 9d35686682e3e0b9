"""Old module names, kept for one release: `import tfbig.manifest` gives tfbig.data.manifest.

MOVED maps each old name to the module that holds its code now. tfbig/__init__.py installs one
import finder for them: importing an old name warns once (a DeprecationWarning naming the new
place) and gives the new module itself, the same object; `python -m tfbig.<old name>` runs the
new module (a command's `run()`), with no warning.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

_DATA = ("albert_data:albert", "formats", "manifest", "prepare", "shards", "sources", "tfrecord",
         "tokenizer")

# old module -> where it lives now (removed in the release after next)
MOVED = {
    **{f"tfbig.{name.partition(':')[0]}": f"tfbig.data.{name.rpartition(':')[2]}"
       for name in _DATA},
    # commands: tfbig/commands/, one module each (tfbig.train itself is the API function)
    "tfbig.train": "tfbig.commands.train",
    "tfbig.train_command": "tfbig.commands.train",
    "tfbig.classify": "tfbig.commands.classify",
    "tfbig.consolidate": "tfbig.commands.consolidate",
    "tfbig.export": "tfbig.commands.export",
    "tfbig.generate": "tfbig.commands.generate",
    "tfbig.cli": "tfbig.commands.cli",
    "tfbig.recipes": "tfbig.commands.recipes",
    "tfbig.squad.cli": "tfbig.commands.squad",
    "tfbig.plan.cli": "tfbig.commands.plan",
    "tfbig.plan.__main__": "tfbig.commands.plan",
    "tfbig.doctor.cli": "tfbig.commands.doctor",
    "tfbig.doctor.__main__": "tfbig.commands.doctor",
    "tfbig.convert.__main__": "tfbig.commands.convert",
    "data_prep.prep": "tfbig.commands.prep",  # data_prep/__init__.py imports tfbig for this
    "launch.local": "tfbig.commands.launch",  # so does launch/__init__.py
    "launch.supervisor": "tfbig.training.supervisor",
    # the loop and what stands beside it
    "tfbig.trainer": "tfbig.training.trainer",
    "tfbig.budget": "tfbig.training.budget",
    "tfbig.logs": "tfbig.training.logs",
    "tfbig.preflight": "tfbig.training.preflight",
    "tfbig.evaluation": "tfbig.training.evaluation",
    "tfbig.finetune": "tfbig.training.finetune",
    "tfbig.distribute.registry": "tfbig.training.registry",
    "tfbig.plan.local": "tfbig.training.local_plan",
    "tfbig.plan.measure": "tfbig.training.measure",
    # what a sharded run's pieces hold
    "tfbig.distribute.tensor_layout": "tfbig.layouts.tensor_layout",
    "tfbig.distribute.zero_checkpoint": "tfbig.layouts.zero_checkpoint",
    "tfbig.pipeline.partition": "tfbig.layouts.partition",
    "tfbig.pipeline.stage_checkpoint": "tfbig.layouts.stage_checkpoint",
    # inputs, checkpoints, shapes
    "tfbig.checkpoint": "tfbig.checkpoints.checkpoint",
    "tfbig.integrity": "tfbig.checkpoints.integrity",
    "tfbig.perf": "tfbig.profiling.perf",
    "tfbig.wordpiece": "tfbig.data.wordpiece",
    "tfbig.glue": "tfbig.data.glue",
    "tfbig.init_checkpoint": "tfbig.convert.init_checkpoint",
    "tfbig.squad": "tfbig.data.squad",
    "tfbig.squad.features": "tfbig.data.squad.features",
    "tfbig.squad.postprocess": "tfbig.data.squad.postprocess",
    "tfbig.squad.evaluate": "tfbig.data.squad.evaluate",
    "tfbig.squad.model": "tfbig.tasks.squad_model",
    "tfbig.plan.models": "tfbig.models.shapes",
}


def _importer_level():
    """The warnings stacklevel of the frame that imported the old name. Frames of importlib's
    bootstrap are not counted by `warnings`; importlib.import_module and this file are."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):
            if name != __file__ and not name.endswith("importlib/__init__.py"):
                return level
            level += 1
        frame = frame.f_back
    return 1


class _Alias(importlib.abc.Loader):
    """Loads an old name as its new module; runpy (`python -m`) gets the new module's code."""

    def __init__(self, old, new):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(f"{self.old} moved to {self.new}: import it from there ({self.old} is "
                      "kept for one release and then removed)", DeprecationWarning,
                      stacklevel=_importer_level())
        return importlib.import_module(self.new)

    def exec_module(self, module):
        """The new module ran when it was imported."""

    def get_code(self, fullname):
        return importlib.util.find_spec(self.new).loader.get_code(self.new)

    def is_package(self, fullname):
        return False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        # runpy (`python -m`) sets sys.argv[0] to the origin: the new module's file
        origin = importlib.util.find_spec(new).origin
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new), origin=origin)


def install():
    """Put the old names' finder first on sys.meta_path (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
