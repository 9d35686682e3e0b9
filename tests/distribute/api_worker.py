"""One process of the API's multi-process tests: examples/own_model.py's MyModel trained with
`tfbig.train` for each scenario of a plan, in one launch (horovodrun or tfbig-launch).

    python api_worker.py PLAN_JSON [CPU_DEVICES]

PLAN_JSON: [{"name": ..., "flags": {tfbig-train flag: value}, "model_dir": ...,
"tensor_layout": {...}, "context_layout": {...} (optional: the task's)}, ...]. The chief writes MODEL_DIR/losses.json
(each logged step's loss), world.json (the number of data-parallel replicas) and weights.npz
(the trained weights as the run reports them: its strategy's gather_full, in the order of the
paths in weights.json); the weights are also the run's checkpoint. A scenario with a
tensor_layout also writes gradients.npz: the first update's gradient of each weight (its path
in gradients.json), the tensor ranks' slices joined. CPU_DEVICES splits the CPU into that
many logical devices first (for strategy="mirrored").
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples"))

import own_model  # noqa: E402

import tfbig  # noqa: E402


def main(plan_path, cpu_devices=0):
    if cpu_devices:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
    with open(plan_path) as f:
        plan = json.load(f)
    run = None
    for scenario in plan:
        if scenario.get("tensor_layout"):
            run = train_recording_gradients(scenario)
            continue
        run = tfbig.train(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                          model_dir=scenario["model_dir"], name="own_model",
                          checkpoint_layers=("transformer_blocks.*",),
                          context_layout=scenario.get("context_layout"),
                          tokens_per_example=own_model.SIZE["maxlen"], **scenario["flags"])
        if run.trainer.strategy.is_chief:
            with open(os.path.join(scenario["model_dir"], "losses.json"), "w") as f:
                json.dump(run.losses, f)
            with open(os.path.join(scenario["model_dir"], "world.json"), "w") as f:
                json.dump({"num_replicas": run.trainer.strategy.num_replicas}, f)
        write_reported_weights(run.trainer, scenario["model_dir"])
    run.close()


def write_reported_weights(trainer, model_dir):
    """MODEL_DIR/weights.npz (+ weights.json, their paths): the trained weights gathered whole
    by the run's strategy (a collective on every rank of a ZeRO or tensor-parallel run)."""
    import numpy as np

    variables = trainer.model.trainable_variables
    gather = getattr(trainer.strategy, "gather_full", None)
    values = gather(variables) if gather else [v.numpy() for v in variables]
    if trainer.strategy.is_chief:
        with open(os.path.join(model_dir, "weights.json"), "w") as f:
            json.dump([v.path for v in variables], f)
        np.savez(os.path.join(model_dir, "weights.npz"), *values)


def train_recording_gradients(scenario):
    """tfbig.train of the scenario's task with its tensor_layout, the first update's gradients
    recorded (tests/equality.py) and written, joined from the tensor ranks, by the chief."""
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from equality import RecordedGradients

    from tfbig.api import Run, _trainer, check_user_flags, configure
    from tfbig.tasks.user import FunctionTask

    config = configure(model_dir=scenario["model_dir"], **scenario["flags"])
    task = FunctionTask(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                        name="own_model", tensor_layout=scenario["tensor_layout"],
                        checkpoint_layers=("transformer_blocks.*",))  # ZeRO-3 gathers these
    check_user_flags(config, task)
    trainer = _trainer(task, config, recorder=True)
    recorded = RecordedGradients(trainer)
    trainer.fit()
    variables = trainer.model.trainable_variables
    first = trainer.strategy.gather_full(variables, recorded.gradients()[0])
    if trainer.strategy.is_chief:
        with open(os.path.join(scenario["model_dir"], "losses.json"), "w") as f:
            json.dump(trainer.logger.losses, f)
        with open(os.path.join(scenario["model_dir"], "world.json"), "w") as f:
            json.dump({"num_replicas": trainer.strategy.num_replicas}, f)
        with open(os.path.join(scenario["model_dir"], "gradients.json"), "w") as f:
            json.dump([v.path for v in variables], f)
        np.savez(os.path.join(scenario["model_dir"], "gradients.npz"), *first)
    write_reported_weights(trainer, scenario["model_dir"])
    return Run(trainer, {}, trainer.logger.losses)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
