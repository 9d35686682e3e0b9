"""Tensor parallelism inside pipeline stages on different ranks: `--strategy=horovod
--pipeline_stages=K --tensor_parallel=T` (GPT, ALBERT and BERT), the full data x pipeline x
tensor grid.

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.tensor_stage).
"""
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, write_layout
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.tensor_collectives import (all_reduce_sum, gather_whole_sequence,
                                                 vocab_parallel_argmax,
                                                 vocab_parallel_cross_entropy)
from tfbig.distribute.tensor_layers import wrap
from tfbig.layouts import stage_checkpoint
from tfbig.layouts.tensor_layout import cut_pieces, split_model
from tfbig.layouts.tensor_plan import TensorGroup, whole_sequence_paths
from tfbig.pipeline.cross_rank import CrossRankPipeline
from tfbig.pipeline.stage_model import build_stage_model


def build_tensor_stage(task, plan, specs, stage_index, device, group, wrap=None):
    """(BuiltStage, {path: (axis, sections)}) of stage `stage_index`, tensor rank
    `group.rank`: only this stage's weights exist, each split one holding its slice.
    `wrap` inserts the collectives (None: an offline copy, for reading checkpoints)."""
    splits = {}

    def build():
        model, found = split_model(task, group, wrap=wrap)
        splits.update(found)
        return model

    return build_stage_model(task, plan, specs, stage_index, device, build=build), splits


def gather_before_whole_sequence(layers, group):
    """With --sequence_parallel, every layer reading the whole sequence (PipeLayer
    .whole_sequence: the masked-LM heads) gets its carry's hidden states gathered whole; the
    layer before it hands on this rank's chunk of the positions."""
    if not group.sequence_parallel:
        return
    for layer in layers:
        if layer.whole_sequence:
            layer.call = _gathered(layer.call, group)


def _gathered(call, group):
    def whole(carry, training):
        x, inputs = carry  # (B, T/t, H): this rank's chunk; the model inputs
        return call((gather_whole_sequence(x, group), inputs), training)

    return whole


class TensorPipeline(CrossRankPipeline):
    """Data x pipeline x tensor: one tensor slice of one stage per rank (module docstring)."""

    def __init__(self, cfg, mesh=None):
        super().__init__(cfg, mesh)
        self.group = TensorGroup(self.mesh.process_set("tensor"), self.mesh.coords["tensor"],
                                 self.mesh.mesh.tensor, cfg.parallel.sequence_parallel)
        self.splits = {}
        self._sequence_summed = []  # per trained variable: replicated, sequence-split inputs

    def build_stage(self, task):
        built, self.splits = build_tensor_stage(task, self.plan, self.specs, self.stage_index,
                                                self.device, self.group, wrap=wrap)
        gather_before_whole_sequence(built.layers, self.group)
        task.vocab_cross_entropy = lambda labels, logits: vocab_parallel_cross_entropy(
            labels, logits, self.group)
        task.vocab_argmax = lambda logits, output_type: vocab_parallel_argmax(
            logits, self.group, output_type)
        return built

    def weight_pieces(self, model):
        return cut_pieces(super().weight_pieces(model), model, self.splits, self.group)

    def describe(self, micro_batch_tokens):
        size, config = self.group.size, self.task.model_config
        if not hasattr(config, "num_heads"):  # a user task's declared tensor_layout
            return (super().describe(micro_batch_tokens) + "\n"
                    f"tensor parallel inside each stage: groups {self.mesh.mesh.groups('tensor')};"
                    f" tensor rank t holds 1/{size} of the stage's {len(self.splits)} split "
                    f"variables of the declared layers (the rest replicated) and sends to "
                    f"tensor rank t of the next stage")
        heads, rows = config.num_heads // size, config.vocab_size // size
        return (super().describe(micro_batch_tokens) + "\n"
                f"tensor parallel inside each stage: groups {self.mesh.mesh.groups('tensor')}; "
                f"tensor rank t holds attention heads t*{heads}..(t+1)*{heads}-1, 1/{size} of "
                f"the MLP width, vocabulary rows t*{rows}..(t+1)*{rows}-1 (the tied copy on "
                f"the last stage too); LayerNorms, position table and row-parallel biases "
                f"replicated (the params and memory above are a stage's before the split); "
                f"tensor rank t of stage k sends to tensor rank t of stage k+1"
                + (f"; sequence parallel: the LayerNorm/dropout regions hold positions "
                   f"t*T/{size}.. on tensor rank t, and so does what it sends (layers reading "
                   f"the whole sequence, ALBERT's and BERT's heads, gather it first)"
                   if self.group.sequence_parallel else ""))

    def make_stage(self, jit_compile):
        # Horovod ops have no XLA kernels: the collectives sit inside the stage's function.
        return super().make_stage(False)

    def _forward_backward(self, variables, scale_loss, jit_compile, timed):
        whole = (set() if getattr(self.task, "tensor_layout", None)  # a user task: no SP
                 else whole_sequence_paths(self.built.model.model))  # the masked-LM heads
        self._sequence_summed = [v.path not in self.splits and v.path not in whole
                                 for v in variables]
        return super()._forward_backward(variables, scale_loss, jit_compile, timed)

    def _before_sync(self, grads):
        """Sequence parallelism: the replicated weights' gradients summed over the tensor
        group first (each rank saw its chunk of the positions; not those of layers after the
        gather, which saw the whole sequence)."""
        return self._sequence_sums(grads)

    def _sequence_sums(self, grads):
        index = [i for i, summed in enumerate(self._sequence_summed) if summed]
        if not (self.group.sequence_parallel and index):
            return grads
        # Horovod: one grouped all-reduce over the stage's tensor group.
        summed = hvd.grouped_allreduce([tf.convert_to_tensor(grads[i]) for i in index],
                                       op=hvd.Sum, process_set=self.group.process_set,
                                       name="pipeline.train.sequence", ignore_name_scope=True)
        grads = list(grads)
        for i, g in zip(index, summed):
            grads[i] = g
        return grads

    def counts(self, variable):
        """Split weights count their slice on every tensor rank, replicated ones count once
        (tensor rank 0); both only on the owner stage."""
        return super().counts(variable) and (variable.path in self.splits
                                             or self.group.rank == 0)

    def norm_options(self, variables):
        """LAMB's per-variable weight and update norms: a split weight's squares summed over
        the tensor group (Horovod), a replicated one's as they are."""
        return {"sum_over_shards": lambda x: all_reduce_sum(x, self.group.process_set),
                "replicated": [v.path not in self.splits for v in variables]}

    # ---- checkpoints: stage k, tensor rank t of data replica 0 writes its slices ------------
    def _stage_dir(self, model_dir):
        return piece_dir(super()._stage_dir(model_dir), "tensor", self.group.rank)

    def restore_dir(self, model_dir):
        stage_checkpoint.check_resume(model_dir, self.num_stages, self.group.size,
                                      zero=self.zero_layout)
        return self._stage_dir(model_dir)

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, stage_checkpoint.LAYOUT_FILE, stage_checkpoint.layout(
                self.built.layers, self.plan, self.splits, self.group.size))
