"""`python -m tfbig.train` runs tfbig-train, whose code is tfbig/train_command.py.

`tfbig.train` is also the public API function (`tfbig.api.train`, read through the package). A
module imported under that name becomes the package's attribute and hides the function, so the
command lives in tfbig.train_command; importing this name still gives the command module for one
release, with a DeprecationWarning (tfbig.deprecation.MOVED).
"""
import importlib

if __name__ == "__main__":
    from tfbig.train_command import run

    run()
else:
    from tfbig.deprecation import moved

    moved(__name__, importlib.import_module("tfbig.train_command"))
