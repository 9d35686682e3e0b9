"""`python -m tfbig.plan ...` is `tfbig-plan ...`."""
from tfbig.plan.cli import run

run()
