"""One row of the memory comparison: a case, what the plan predicts for it, what is held.

Rows for other layouts (ZeRO partitions, tensor-parallel slices, pipeline stages) plug in as
further `Case`s with their layout and a measurement taken on their rank.
"""
import dataclasses

from tfbig.plan import estimate, hardware
from tfbig.models import shapes as models

CPU = hardware.Device("cpu", 1e11, 2 ** 40, 1e10, 1e10, 1.0, 0.0)


@dataclasses.dataclass
class Case:
    name: str
    model: dict  # GPTConfig fields over the tiny preset
    batch_size: int  # global batch
    xla: bool = True
    layout: estimate.Layout = estimate.Layout()

    @property
    def micro_batch(self):
        return self.batch_size // (self.layout.data * self.layout.num_microbatches)


def predicted(case):
    """The plan's bytes for the case: model state and the step's transient peak."""
    cfg = models.model_config("gpt", "tiny", **case.model)
    shape = models.shape_of(cfg, "gpt", cfg.seq_length)
    mem = estimate.memory(shape, case.layout, case.micro_batch, "fp32", CPU)
    return {"model_state": mem["parameters"] + mem["optimizer"],
            "step_peak": mem["gradients"] + mem["activations"]}


def rank_layout(fixed, world_size):
    """The Layout of a rank from the layout flags of its config (search.layout_from_config)."""
    t, k = fixed["tensor_parallel"], fixed["pipeline_stages"]
    return estimate.Layout(world_size // (t * k), k, t, fixed["zero_stage"],
                           fixed["shard_degree"], fixed["num_microbatches"],
                           fixed["activation_checkpointing"], fixed["sequence_parallel"],
                           fixed["schedule"])


def predicted_rank_state(record):
    """The plan's model-state bytes for a rank's record from horovod_memory_worker.py."""
    cls, _ = models.load_configs("gpt")
    cfg = cls(**record["model_config"])
    shape = models.shape_of(cfg, "gpt", cfg.seq_length)
    layout = rank_layout(record["layout"], record["world_size"])
    mem = estimate.memory(shape, layout, 1, "fp32", CPU, stage=record["stage"])
    return mem["parameters"] + mem["optimizer"]
