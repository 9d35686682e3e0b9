"""tfbig.plan: memory per GPU, step time and time-to-train of a layout, and the layout to use.

    models.py    the model's sizes from tfbig's own configs (read without importing Keras)
    hardware.py  GPU table, cluster, and the few physical constants
    estimate.py  memory and step time of one layout (closed forms)
    search.py    candidate layouts, named errors for impossible ones, ranking
    report.py    text and JSON
    cli.py       `tfbig-plan` (flags named as tfbig-train's)
    local.py     `tfbig-train --plan_only`: the plan of a training config on this machine

Nothing here imports TensorFlow except local.py's device probe.
"""
