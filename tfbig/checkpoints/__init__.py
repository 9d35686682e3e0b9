"""Checkpoint keys, per-rank piece paths and saves (checkpoint.py); the integrity manifest
that tells an intact checkpoint from a damaged one (integrity.py)."""
