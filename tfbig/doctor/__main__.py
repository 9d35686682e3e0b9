"""`python -m tfbig.doctor`: the same as `tfbig-doctor`."""
from tfbig.doctor.cli import run

run()
