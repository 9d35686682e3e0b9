"""tfbig.plan: memory per GPU, step time and time-to-train of a layout, and the layout to use.

    hardware.py  GPU table, cluster, and the few physical constants
    estimate.py  memory and step time of one layout (closed forms)
    search.py    candidate layouts, named errors for impossible ones, ranking
    report.py    text and JSON
    calibration.py  a tfbig-doctor measurement read as the plan's rates
    user.py      the plan of a user's own model

The model's sizes come from tfbig.models.shapes; the command is tfbig.commands.plan;
`tfbig-train --plan_only` plans on this machine through tfbig.training.local_plan. Nothing
here imports TensorFlow.
"""
