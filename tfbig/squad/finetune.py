"""Fine-tune ALBERT or BERT on SQuAD features, and predict start/end logits.

The backbone comes from a run directory: a tfbig-train ALBERT run (config.json, tokenizer.model
and its latest checkpoint) or a BERT/ALBERT converted by tfbig-convert (BERT: vocab.txt and
the casing in config.json; ALBERT: the released SentencePiece model as tokenizer.model, read
with ALBERT's text preparation), or is initialised at random with the same configuration (the
ablation that shows what pretraining is worth). The span head is always new.

Loss: mean of the start and end cross-entropies over the sequence positions (BERT). AdamW
with linear warmup and linear decay to zero, weight decay off LayerNorm, biases and
embeddings (tfbig.optim).

Example:
    config, tokenizer = pretrained_config("runs/albert")
    model = build_model(config, init_checkpoint="runs/albert")
    history = train(model, features, batch_size=32, num_epochs=2, learning_rate=5e-5)
    start_logits, end_logits = predict(model, dev_features)
"""
import json
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfbig.checkpoint import model_variables
from tfbig.config import TrainConfig
from tfbig.models.albert import AlbertConfig, AlbertForQuestionAnswering
from tfbig.models.bert import BertConfig, BertForQuestionAnswering

INPUTS = ("input_ids", "segment_ids", "input_mask")
FAMILIES = {"albert": (AlbertConfig, AlbertForQuestionAnswering),
            "bert": (BertConfig, BertForQuestionAnswering)}


def family_of(config):
    """"albert" or "bert": the model_format of a config."""
    return next(name for name, (cls, _) in FAMILIES.items() if isinstance(config, cls))


def read_model_dir(model_dir, saved, flag="--init_checkpoint"):
    """(config, tokenizer) from a run directory's config.json dict `saved`: ALBERT with
    tokenizer.model (SentencePiece: `sentencepiece_tokenizer`), BERT with the WordPiece vocabulary it names."""
    family = saved.get("model_format")
    if family not in FAMILIES:
        raise ValueError(f"{flag}={model_dir} holds a {family!r} model; tfbig-squad fine-tunes "
                         f"ALBERT (tfbig-train --model=albert) or BERT (tfbig-convert)")
    config = FAMILIES[family][0](**saved["model_config"])
    if family == "bert":
        from tfbig.wordpiece import WordPieceTokenizer

        return config, WordPieceTokenizer.from_run(model_dir, saved["tokenizer"])
    tokenizer = os.path.join(model_dir, "tokenizer.model")
    if not os.path.isfile(tokenizer):
        raise ValueError(f"{flag}={model_dir}: no tokenizer.model next to the checkpoint")
    return config, sentencepiece_tokenizer(tokenizer)


def sentencepiece_tokenizer(path):
    """An ALBERT run's tokenizer.model: tfbig's own SentencePiece (tfbig-train), or a released
    ALBERT one (tfbig-convert of Google's or Hugging Face's ALBERT) with ALBERT's text
    preparation, encoding a question or a context as one segment (no [SEP] per line)."""
    from tfbig.data import load_tokenizer
    from tfbig.data.albert_spm import AlbertSentencePiece

    tokenizer = load_tokenizer(path)
    if isinstance(tokenizer, AlbertSentencePiece):
        return AlbertSentencePiece(tokenizer.processor, path, line_ends=False)
    return tokenizer


def pretrained_config(model_dir):
    """(config, tokenizer) of a tfbig-train --model=albert run or a tfbig-convert run."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--init_checkpoint={model_dir}: no config.json; expected the "
                         "--model_dir of a tfbig-train --model=albert run or the --output_dir "
                         "of tfbig-convert")
    with open(path) as file:
        return read_model_dir(model_dir, json.load(file))


def build_model(config, init_checkpoint=None, seed=0):
    """An AlbertForQuestionAnswering or BertForQuestionAnswering (by the config's type); its
    backbone restored from `init_checkpoint` (a run directory or checkpoint path) if given,
    else randomly initialised."""
    keras.utils.set_random_seed(seed)
    family = family_of(config)
    model = FAMILIES[family][1](config, name=f"{family}_qa")
    model.build()
    if init_checkpoint:
        path = tf.train.latest_checkpoint(init_checkpoint) if os.path.isdir(init_checkpoint) \
            else init_checkpoint
        if not path:
            raise ValueError(f"--init_checkpoint={init_checkpoint}: no checkpoint found")
        backbone = {name: v for name, v in model_variables(model).items()
                    if name.startswith("backbone/")}  # the trainer's keys: Keras paths
        status = tf.train.Checkpoint(model=backbone).restore(path)
        status.expect_partial().assert_existing_objects_matched()
    return model


def restore_model(model, prefix):
    """Read the weights tfbig-squad wrote (tfbig.distribute.finetune.write_checkpoint)."""
    tf.train.Checkpoint(model=model_variables(model)).read(prefix).assert_existing_objects_matched()


def _dataset(features, names, batch_size, seed=None, repeat=False):
    arrays = {name: features.arrays[name] for name in names}
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if seed is not None:
        dataset = dataset.shuffle(len(features), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    return dataset.batch(batch_size, drop_remainder=repeat).prefetch(tf.data.AUTOTUNE)


def span_loss(outputs, batch):
    """Mean of start and end cross-entropy over positions (float32)."""
    start = tf.nn.sparse_softmax_cross_entropy_with_logits(batch["start_positions"],
                                                           outputs["start_logits"])
    end = tf.nn.sparse_softmax_cross_entropy_with_logits(batch["end_positions"],
                                                         outputs["end_logits"])
    return tf.reduce_mean(start + end) / 2.0


def precision_of(model):
    """The --precision a model was built under (Keras' global dtype policy at build time)."""
    return {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}.get(
        model.compute_dtype, "fp32")


def train(model, features, batch_size=32, num_epochs=2.0, learning_rate=5e-5,
          warmup_fraction=0.1, weight_decay=0.01, max_steps=0, seed=0, xla=True,
          log_every=50, log=print, strategy=None):
    """Fine-tune `model` on training `features`; returns the list of per-step losses.

    Steps = num_epochs x features / batch_size (or max_steps if > 0). `strategy` (a
    tfbig.distribute Strategy: Horovod's, MultiWorkerMirrored's; `model` built in its scope):
    each replica trains on its share of every global batch of `batch_size`, gradients and
    losses averaged over replicas (tfbig.distribute.finetune); with --tensor_parallel `model`
    is this rank's slice, with --strategy=pipeline it is cut into stages, the loss on the last
    (tfbig.distribute.finetune_parallel.build_model). A model built under
    mixed_float16 (tfbig.distribute.finetune.precision_policy) trains with dynamic loss
    scaling, as tfbig-train does: a step with non-finite gradients is skipped (and logged).
    """
    from tfbig.distribute.base import Strategy
    from tfbig.distribute.finetune import (check_batch, current_loss_scale, make_forward_backward,
                                           replica_batches, skipped_steps, train_step)
    from tfbig.distribute.finetune_parallel import compiled

    strategy = strategy or Strategy()
    if len(features) < batch_size:
        raise ValueError(f"--train_batch_size={batch_size} is above the {len(features)} "
                         "training features")
    check_batch(strategy, batch_size)
    steps = max_steps or max(1, math.ceil(num_epochs * len(features) / batch_size))
    settings = TrainConfig(optimizer="adamw", learning_rate=learning_rate, max_steps=steps,
                           warmup_steps=int(warmup_fraction * steps), lr_schedule="linear",
                           min_lr_ratio=0.0, weight_decay=weight_decay, beta_2=0.999,
                           epsilon=1e-6, grad_clip_norm=1.0, precision=precision_of(model))
    unused = {id(v) for v in model.backbone.pooler.weights}  # the span head reads tokens only
    variables = [v for v in model.trainable_variables if id(v) not in unused]
    with strategy.scope():
        optimizer = strategy.build_optimizer(settings, variables)
    strategy.broadcast_variables(model.variables)  # every replica starts from the chief's

    def loss_fn(batch):
        return span_loss(model({k: batch[k] for k in INPUTS}, training=True), batch)

    step = train_step(strategy, make_forward_backward(  # not XLA with --tensor_parallel
        strategy, loss_fn, optimizer, variables, compiled(strategy, xla)), optimizer, variables)
    names = INPUTS + ("start_positions", "end_positions")
    arrays = {name: features.arrays[name] for name in names}
    batches = replica_batches(strategy, lambda: tf.data.Dataset.from_tensor_slices(
        arrays).shuffle(len(features), seed=seed, reshuffle_each_iteration=True).repeat(),
        batch_size)
    losses, scales, start = [], [current_loss_scale(optimizer)], time.perf_counter()
    for index in range(steps):
        losses.append(float(step(next(batches))))
        scales.append(current_loss_scale(optimizer))  # halved after a skipped fp16 step
        if log and ((index + 1) % log_every == 0 or index + 1 == steps):
            recent = np.mean(losses[-log_every:])
            log(f"step {index + 1}/{steps} | loss {recent:.4f} | "
                f"{(index + 1) * batch_size / (time.perf_counter() - start):.1f} features/s"
                + (f" | loss scale {scales[-1]:g}, {skipped_steps(scales)} skipped"
                   if settings.precision == "mixed_float16" else ""))
    return losses


def predict(model, features, batch_size=64, xla=True):
    """(start_logits, end_logits), float32 numpy arrays of shape (num_features, T)."""
    forward = tf.function(lambda batch: model(batch, training=False), jit_compile=xla)
    starts, ends = [], []
    for batch in _dataset(features, INPUTS, batch_size):
        out = forward(batch)
        starts.append(out["start_logits"].numpy())
        ends.append(out["end_logits"].numpy())
    return np.concatenate(starts), np.concatenate(ends)
