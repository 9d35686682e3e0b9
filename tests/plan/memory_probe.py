"""One row of the memory comparison: a case, what the plan predicts for it, what is held.

Rows for other layouts (ZeRO partitions, tensor-parallel slices, pipeline stages) plug in as
further `Case`s with their layout and a measurement taken on their rank.
"""
import dataclasses

from tfbig.plan import estimate, hardware, models

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
    mem = estimate.memory(shape, case.layout, case.micro_batch, "fp32", CPU, last=True)
    return {"model_state": mem["parameters"] + mem["optimizer"],
            "step_peak": mem["gradients"] + mem["activations"]}
