"""tfbig.doctor: `tfbig-doctor`, a check of a cluster before training on it.

    probes.py       what one rank measures on its own: build, devices, XLA, precisions, matmul
                    FLOP/s, memory bandwidth, one tiny training step
    collectives.py  what the ranks measure together: all-reduce, all-gather and reduce-scatter
                    over the host, cross-host and MiCS partition groups (nccl-tests' algbw/busbw)
    findings.py     stragglers (a rank or host >= 20% below the median), missing builds,
                    the text report and the calibration file tfbig-plan reads
    checks.py       one rank's record, the collectives, the report (tfbig.commands.doctor is
                    the command: flags, the JSON report)

Launched alone or under horovodrun / mpirun / srun, as training is.
"""
