"""Modules that moved keep their old name for one release, with a DeprecationWarning.

A shim at the old path (e.g. tfbig/manifest.py, now tfbig.data.manifest) imports the new module
and calls `moved`, which warns once per process, naming the new place, and makes the old name
the new module itself (every name, private ones included, and the same objects):

    moved(__name__, importlib.import_module("tfbig.data.manifest"))

MOVED lists every shim: tests/test_public_api.py imports each and checks its warning.
"""
import sys
import warnings

# old module -> where it lives now (removed in the release after next)
MOVED = {
    "tfbig.albert_data": "tfbig.data.albert",
    "tfbig.formats": "tfbig.data.formats",
    "tfbig.manifest": "tfbig.data.manifest",
    "tfbig.prepare": "tfbig.data.prepare",
    "tfbig.shards": "tfbig.data.shards",
    "tfbig.sources": "tfbig.data.sources",
    "tfbig.tfrecord": "tfbig.data.tfrecord",
    "tfbig.tokenizer": "tfbig.data.tokenizer",
    # the command moved out of the public API function's name (tfbig/train.py says why)
    "tfbig.train": "tfbig.train_command",
}


def moved(old, module):
    """Warn that module `old` moved to `module` and make the old name that module."""
    warnings.warn(f"{old} moved to {module.__name__}: import it from there ({old} is kept for "
                  "one release and then removed)", DeprecationWarning, stacklevel=3)
    sys.modules[old] = module
