"""Launcher scripts and manifests: Horovod on one or more hosts, mpirun, Slurm, Kubernetes.

`python -m launch.local` is `tfbig-launch` (tfbig.commands.launch): importing tfbig here installs
the old names' finder (tfbig.compat), which runs it.
"""
import tfbig  # noqa: F401
