"""The loop and what stands beside it: the Trainer (trainer.py), the backend registry that
picks a Strategy from the flags (registry.py), the time budget, logs, preflight checks,
evaluation batches, fine-tuning recipes, consolidation of sharded runs, and the plan of a
config on this machine (local_plan.py, measure.py); the processes of a local job
(workers.py) and the supervisor that restarts them (supervisor.py)."""
