"""GPT language modelling as a task: a single-replica view of the training procedure.

A task knows the model family, its data format and its loss; it knows nothing about devices or
distribution. The trainer asks it for the data directory, the model, batches and the loss.
"""
import math

import tensorflow as tf

from tfbig import data
from tfbig.models.gpt import GPT, GPTConfig

DEFAULT_VOCAB_SIZE = 8000  # tokenizer trained on the embedded corpus when no --data_dir is given


class GPTTask:
    """Next-token prediction on packed `input_ids` sequences of seq_length + 1 tokens, or, on
    "completion" data (prompt-completion pairs, tfbig.data.completion), on the completion
    tokens only: the loss is the mean over the tokens `loss_mask` marks.

    `vocab_cross_entropy(labels, logits)` gives per-token losses; a backend that splits the
    vocabulary over ranks (tensor parallelism) sets its own on the instance."""

    format = "gpt"  # the data's: "gpt", or "completion" when the data directory says so
    model_format = "gpt"  # config.json's
    vocab_cross_entropy = staticmethod(tf.nn.sparse_softmax_cross_entropy_with_logits)

    def __init__(self, train):
        self.train = train
        self.data_dir = train.data_dir or self._prepare_default()
        self.manifest = data.open_manifest(self.data_dir)  # one directory or a mixture
        if self.manifest.format == "completion":  # fine-tuning pairs: the loss on completions
            self.format = "completion"
        self.manifest.check(format=self.format)
        self.seq_length = train.seq_length or self.manifest.seq_length
        self.manifest.check(seq_length=self.seq_length)
        self.model_config = self._model_config()
        self.model_config.check_inputs(self.seq_length, self.manifest.vocab_size)

    def _prepare_default(self):
        """Prepare the embedded Shakespeare corpus once for the preset's seq_length (cached)."""
        seq_length = self.train.seq_length or GPTConfig.from_preset(self.train.preset).seq_length
        out = data.default_data_dir(seq_length, DEFAULT_VOCAB_SIZE)
        # tfbig owns this cache: data made by an older recipe is rebuilt, not refused.
        return data.prepare_locked(out, seq_length=seq_length, vocab_size=DEFAULT_VOCAB_SIZE,
                                   overwrite=True)

    def _model_config(self):
        t = self.train
        return GPTConfig.from_preset(
            t.preset, vocab_size=self.manifest.vocab_size,
            seq_length=max(self.seq_length, GPTConfig.from_preset(t.preset).seq_length),
            num_layers=t.num_layers or None, hidden_size=t.hidden_size or None,
            num_heads=t.num_heads or None, dropout=t.dropout if t.dropout >= 0 else None,
            attention=t.attention, attention_block_size=t.attention_block_size)

    def build_model(self):
        """The model, built (variables created) so it can be checkpointed and counted."""
        model = GPT(self.model_config, name="gpt")
        model.build((None, self.seq_length))
        return model

    def dataset(self, split, batch_size, input_context=None, *, seed=0, repeat=True,
                shuffle=True, start=0, drop_remainder=True):
        """Batches of {"input_ids": int32 (batch_size, seq_length + 1)} for one pipeline."""
        return data.make_dataset(
            self.data_dir, split, batch_size, format=self.format, seq_length=self.seq_length,
            vocab_size=self.model_config.vocab_size, input_context=input_context, seed=seed,
            shuffle=shuffle, repeat=repeat, deterministic=self.train.deterministic,
            skip_corrupt=self.train.skip_corrupt, start=start,
            trace=getattr(self.train, "data_trace", "") if split == "train" else "",
            drop_remainder=drop_remainder)

    def flops_per_token(self):
        """Model training FLOPs per token at this task's seq_length (for MFU)."""
        return self.model_config.flops_per_token(self.seq_length)

    def model_inputs(self, batch):
        return batch["input_ids"][:, :-1]

    def loss_from_outputs(self, logits, batch):
        """Mean next-token cross-entropy in float32 (over the completion tokens of completion
        data), and the metrics to average."""
        targets = batch["input_ids"][:, 1:]
        losses = self.vocab_cross_entropy(targets, tf.cast(logits, tf.float32))  # (B, T)
        if "loss_mask" not in batch:
            loss = tf.reduce_mean(losses)
            return loss, {"loss": loss}
        mask = tf.cast(batch["loss_mask"], tf.float32)  # (B, T): 1 on completion targets
        loss = tf.reduce_sum(losses * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)
        return loss, {"loss": loss}

    def loss(self, model, batch, training=False):
        return self.loss_from_outputs(model(self.model_inputs(batch), training=training), batch)

    def validation_outputs(self, logits, batch):
        """Per-sequence mean next-token cross-entropy {"loss": float32 (B,)} (over the
        completion tokens of completion data)."""
        targets = batch["input_ids"][:, 1:]
        losses = self.vocab_cross_entropy(targets, tf.cast(logits, tf.float32))  # (B, T)
        if "loss_mask" not in batch:
            return {"loss": tf.reduce_mean(losses, axis=1)}
        mask = tf.cast(batch["loss_mask"], tf.float32)
        return {"loss": tf.reduce_sum(losses * mask, axis=1) /
                tf.maximum(tf.reduce_sum(mask, axis=1), 1.0)}

    def validation_step(self, model, batch):
        """What the metric needs from one batch (single replica; the trainer gathers it)."""
        return self.validation_outputs(model(self.model_inputs(batch), training=False), batch)

    def reduce_aggregated_logs(self, outputs):
        """Loss, perplexity and bits per byte (tokenizer-independent) of the gathered
        validation outputs (numpy, one row per sequence)."""
        loss = float(outputs["loss"].mean())
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                "bits_per_byte": self.manifest.bits_per_byte(loss)}

    def tokenizer(self):
        return data.load_tokenizer(self.manifest.tokenizer_path)  # SentencePiece or GPT-2's BPE
