"""Deprecated: moved to tfbig.data.formats (this name works for one more release)."""
import importlib

from tfbig.deprecation import moved

# the module itself (tfbig.data's attribute of that name may be a function: tfbig.data.prepare)
moved(__name__, importlib.import_module("tfbig.data.formats"))
