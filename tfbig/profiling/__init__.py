"""See what training is doing: throughput, MFU, step-time breakdown, system monitor, diagnosis.

    profiler.py  RunProfiler: what the trainer records each run (see its docstring for files)
    timing.py    StepTimer and in-graph timing of the gradient all-reduce
    monitor.py   SystemMonitor: CPU/memory/disk/GPU samples in a background thread
    diagnose.py  load a run's profile, find its bottleneck
    report.py    PNG charts and the diagnosis (the command: tfbig.commands.profile)
    perf.py      peak FLOP/s of a device and MFU
"""
