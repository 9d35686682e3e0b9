"""One rank of an elastic Horovod run for tests/distribute/test_elastic.py.

    horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script S \
        python elastic_worker.py PLAN_JSON

PLAN_JSON: {"config": tfbig.config.to_dict, "out": dir, "step_seconds": float, "user_task":
bool (examples/own_model.py's functions as a tfbig.Task, through tfbig.api's flag checks, in
place of the config's GPT), "die_before_first_sync": a rank that kills itself (SIGKILL) as
the first sync of the elastic state begins}. Each process
writes OUT/pid{PID}.rank (its first rank), and appends to OUT/pid{PID}.jsonl one line per
optimizer step it runs: {"time", "step", "world", "rank", "rows"} where rows fingerprint the
records of its slice of the batch; the chief adds {"loss"}. At the end the chief writes
OUT/final.npz (weights) and OUT/final.json (step, resets). step_seconds slows each step so the
test can kill and add ranks mid-run.
"""
import json
import os
import signal
import sys
import time
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.distribute import elastic  # noqa: E402
from tfbig.training.registry import get_strategy  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


def fingerprint(row):
    return zlib.crc32(np.ascontiguousarray(row, np.int64).tobytes())


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")
ROWS_KEY = "input_ids"  # tfbig's own tasks' token ids
USER_ROWS_KEY = "x000"  # a user task's flat batch: its inputs (tfbig.tasks.user_adapter.KEYS)


def own_model_task(cfg):
    """examples/own_model.py's MyModel, loss and data as the UserTask the Trainer reads, `cfg`
    checked as tfbig.train checks it."""
    sys.path.insert(0, EXAMPLES)
    import own_model

    from tfbig.api import check_user_flags
    from tfbig.tasks.user import FunctionTask
    from tfbig.tasks.user_adapter import UserTask

    task = FunctionTask(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                        name="own_model", tokens_per_example=own_model.SIZE["maxlen"])
    check_user_flags(cfg, task)
    return UserTask(task)


class Recorded(Trainer):
    """The trainer, writing what each step consumed (test instrumentation only)."""

    def __init__(self, cfg, strategy, out, step_seconds, task=None):
        self.out, self.step_seconds = out, step_seconds
        self.record = open(os.path.join(out, f"pid{os.getpid()}.jsonl"), "a")
        super().__init__(cfg, strategy=strategy, task=task)

    def _train_iterator(self):
        iterator = super()._train_iterator()
        step = int(self.step.numpy())
        for batch in iterator:
            step += 1
            time.sleep(self.step_seconds)
            ids = batch[ROWS_KEY if ROWS_KEY in batch else USER_ROWS_KEY].numpy()
            rows = ids.reshape(-1, ids.shape[-1])
            self._pending = {"step": step, "world": self.strategy.num_replicas,
                             "rank": self.strategy.rank,
                             "rows": [fingerprint(r) for r in rows]}
            yield batch

    def _log_train(self, step, out, perf):
        values = super()._log_train(step, out, perf)
        entry = {**self._pending, "time": time.time(), "loss": values["loss"]}
        self.record.write(json.dumps(entry) + "\n")
        self.record.flush()
        return values


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    cfg = config_lib.from_dict(plan["config"])
    task = own_model_task(cfg) if plan.get("user_task") else None
    strategy = get_strategy("horovod", cfg)
    if plan.get("die_before_first_sync") == strategy.rank:
        # This rank dies (SIGKILL) as the ranks' first collective, the state's sync, begins.
        elastic.VariablesState.sync = lambda state: os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(plan["out"], f"pid{os.getpid()}.rank"), "w") as f:
        f.write(str(strategy.rank))
    trainer = Recorded(cfg, strategy, plan["out"], plan["step_seconds"], task)
    summary = trainer.fit()
    variables = trainer.model.trainable_variables
    weights = (strategy.gather_full(variables) if hasattr(strategy, "gather_full")  # ZeRO-3
               else [v.numpy() for v in variables])  # (a collective: every rank)
    if strategy.is_chief:
        np.savez(os.path.join(plan["out"], "final.npz"), *weights)
        with open(os.path.join(plan["out"], "final.json"), "w") as f:
            json.dump({"step": summary["step"], "resets": strategy.resets,
                       "world": strategy.num_replicas}, f)
    strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
