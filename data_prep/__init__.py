"""Leaves beside tfbig: the Shakespeare question-answer generator (shakespeare_qa.py).

`python -m data_prep.prep` is `tfbig-prep` (tfbig.commands.prep): importing tfbig here installs
the old names' finder (tfbig.compat), which runs it.
"""
import tfbig  # noqa: F401
