"""Tensor parallelism inside pipeline stages on different ranks: `--strategy=horovod
--pipeline_stages=K --tensor_parallel=T` (GPT, ALBERT and BERT), the full data x pipeline x
tensor grid.

World = D x K x T ranks (tfbig.distribute.mesh; `--placement=cluster` keeps the T ranks of a
stage adjacent, on one host). The rank at (data d, pipeline k, tensor t):

    builds      stage k only (tfbig.pipeline.stage_model: other stages' weights are empty
                placeholders), its layers tensor-split by the plan of tfbig.distribute
                .tensor_layout (`split_model`, slice t): heads, MLP columns/rows and
                vocabulary rows, with the conjugate collectives over the stage's tensor group
                (tfbig.distribute.tensor_parallel)
    exchanges   activations forward / gradients back with tensor rank t of stages k-1 and k+1
                (its pipeline group). A stage boundary is a block output: after the
                row-parallel all-reduce it is replicated over the tensor group, and so is its
                gradient (the next stage's column-parallel entry all-reduces it backward), so
                each tensor rank sends its own copy to its twin: T independent point-to-point
                links, no extra collective, the same bytes per link as without tensor
                parallelism
    loss        on the last stage, the vocabulary-parallel cross-entropy (no rank forms full
                (batch, seq, vocab) logits); GPT's tied token table is vocabulary-split on
                stage 0 and its copy on the last stage is split the same way, so the copy's
                gradient (summed over the pipeline group: same tensor rank, same slice) is
                exactly slice t of the table's gradient. ALBERT alike: its word table
                (tied to the MLM head) and the MLM bias vocabulary-split, the factorised
                embedding projection replicated (its input, the embedding sum, is replicated
                after the word table's all-reduce); a shared block run by layers on several
                stages is held by each of them, split by the same plan, so tensor rank t of
                every stage holds slice t and the gradient parts summed over the pipeline
                group are slice t of the block's one gradient. BERT as ALBERT, a block of
                its own per layer and no projection; the pooler and the NSP (SOP) head are
                replicated on the last stage's tensor ranks, as the plan
                (tfbig.layouts.tensor_layout.masked_lm_plan) has them
    gradients   averaged over the data group (the D ranks holding the same slice of the same
                stage); the global norm, non-finite count and stop flag go in one all-reduce
                over the model group (pipeline x tensor): a split weight counted by every
                tensor rank (its slice), a replicated one (LayerNorms, position table,
                row-parallel biases) by tensor rank 0 only, a tied copy only on its owner;
                LAMB's trust ratio of a split weight takes its norms summed over the tensor
                group (the whole weight's)

Checkpoints: each rank of data replica 0 writes what it holds, stage k tensor rank t in
piece_dir(piece_dir(MODEL_DIR, "pipeline", k), "tensor", t) (MODEL_DIR for 0/0,
MODEL_DIR/pipeline/stage-k/tensor/rank-t in general); MODEL_DIR/pipeline.json records the
stages and the tensor splits. `python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR` writes a
single-device checkpoint; tfbig-generate/export read
the pieces directly. Resuming needs the same --pipeline_stages and --tensor_parallel.

--sequence_parallel: inside each stage the LayerNorm/dropout regions are split along the
sequence over the tensor group (reduce-scatter/all-gather instead of all-reduce, as with
--tensor_parallel alone), so a block output is this rank's chunk of the positions and tensor
rank t sends chunk t to its twin (1/T of the bytes per link); the replicated weights'
gradients (LayerNorms, position table, row-parallel biases: each rank saw its chunk) are
summed over the tensor group before the data average. ALBERT's and BERT's heads read the
[CLS] token and masked positions anywhere in the sequence (PipeLayer.whole_sequence): the last
stage gathers its chunks whole before them (backward each rank keeps its chunk's rows, the
heads' gradient being complete on every rank), so the heads' replicated weights (pooler,
MLM transform, NSP/SOP head) see the whole sequence and are not summed over the group.

Example (2 stages x 2 tensor ranks x 2 replicas):
    horovodrun -np 8 -H localhost:8 --gloo tfbig-train --strategy=horovod \\
        --pipeline_stages=2 --tensor_parallel=2 --num_microbatches=4 --schedule=1f1b
"""
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, write_layout
from tfbig.distribute.horovod_keras import hvd
from tfbig.layouts.tensor_layout import TensorGroup, split_model, whole_sequence_paths
from tfbig.distribute.tensor_parallel import (_all_reduce_sum, _wrap, gather_whole_sequence,
                                              vocab_parallel_argmax,
                                              vocab_parallel_cross_entropy)
from tfbig.layouts import stage_checkpoint
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
                                                self.device, self.group, wrap=_wrap)
        gather_before_whole_sequence(built.layers, self.group)
        task.vocab_cross_entropy = lambda labels, logits: vocab_parallel_cross_entropy(
            labels, logits, self.group)
        task.vocab_argmax = lambda logits, output_type: vocab_parallel_argmax(
            logits, self.group, output_type)
        return built

    def describe(self, micro_batch_tokens):
        size, config = self.group.size, self.task.model_config
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

    def _specs(self, micro_batch):
        specs, metric_spec = super()._specs(micro_batch)
        self.sent = specs  # for inspection: what stage k < K-1 sends (a chunk with SP)
        return specs, metric_spec

    def _forward_backward(self, variables, scale_loss, jit_compile, timed):
        whole = whole_sequence_paths(self.built.model.model)  # the masked-LM heads
        self._sequence_summed = [v.path not in self.splits and v.path not in whole
                                 for v in variables]
        return super()._forward_backward(variables, scale_loss, jit_compile, timed)

    def all_reduce_gradients(self, grads):
        """Sequence parallelism: the replicated weights' gradients summed over the tensor
        group first (each rank saw its chunk of the positions; not those of layers after the
        gather, which saw the whole sequence); then as without."""
        return super().all_reduce_gradients(self._sequence_sums(grads))

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
        return {"sum_over_shards": lambda x: _all_reduce_sum(x, self.group.process_set),
                "replicated": [v.path not in self.splits for v in variables]}

    # ---- checkpoints: stage k, tensor rank t of data replica 0 writes its slices ------------
    def _stage_dir(self, model_dir):
        return piece_dir(super()._stage_dir(model_dir), "tensor", self.group.rank)

    def restore_dir(self, model_dir):
        stage_checkpoint.check_resume(model_dir, self.num_stages, self.group.size)
        return self._stage_dir(model_dir)

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, stage_checkpoint.LAYOUT_FILE, stage_checkpoint.layout(
                self.built.layers, self.plan, self.splits, self.group.size))
