"""Masked-LM pretraining tasks (ALBERT, BERT): what they share, as one base class.

A single-replica view, like tasks.gpt: the data directory, the model, batches and the loss.
Loss = masked-LM cross-entropy (mean over real predictions, `masked_lm_weights`) + the
sentence-pair cross-entropy (mean over sequences): sentence order for ALBERT ("sop"), next
sentence for BERT ("nsp"). Metrics: mlm_loss, {pair}_loss, mlm_accuracy, {pair}_accuracy.

Shards hold the standard BERT/ALBERT pretraining features (tfbig.data.albert). Their masks
are static; with --dynamic_masking the input pipeline restores the original tokens and draws
new token-level masks for every batch (stateless RNG keyed by the seed and the batch number,
so a resumed run draws the same masks).

A subclass sets `format`, `pair` ("sop" | "nsp"), `model_name`, and `_model_config()` /
`_model_class`.
"""
import dataclasses

import tensorflow as tf

from tfbig import data
from tfbig.config import AlbertTrainConfig
from tfbig.data import MaskingOptions, MaskingVocab


class MaskedLMTask:
    """MLM + a sentence-pair head on fixed-length records of seq_length tokens."""

    format = ""  # record format of the shards (tfbig-prep --format)
    pair = ""  # the sentence-pair head: "sop" or "nsp" (its logits are f"{pair}_logits")
    model_name = ""  # the Keras model's name
    config_section = "albert"  # ExperimentConfig section with the --dynamic_masking options
    masking_defaults = {}  # MaskingOptions of the embedded corpus prepared for an empty --data_dir
    # Over the vocabulary: a backend that splits it over ranks (tensor parallelism) sets its own.
    vocab_cross_entropy = staticmethod(tf.nn.sparse_softmax_cross_entropy_with_logits)
    vocab_argmax = staticmethod(lambda logits, output_type: tf.argmax(
        logits, -1, output_type=output_type))

    def __init__(self, train, masking=None):
        self.train = train
        self.albert = masking or AlbertTrainConfig()  # the --dynamic_masking options
        self.data_dir = train.data_dir or self._prepare_default()
        self.manifest = data.open_manifest(self.data_dir)  # one directory or a mixture
        self.manifest.check(format=self.format)
        self.seq_length = train.seq_length or self.manifest.seq_length
        self.manifest.check(seq_length=self.seq_length)
        options = self.manifest.info.get("format_options", {})
        self.max_predictions_per_seq = int(options.get("max_predictions_per_seq", 20))
        self.model_config = self._model_config()
        self.model_config.check_inputs(self.seq_length, self.manifest.vocab_size)
        self._masking = None
        if self.albert.dynamic_masking:
            self._masking = DynamicMasking(MaskingVocab.from_tokenizer(self.tokenizer()),
                                           self.albert.dynamic_masked_lm_prob,
                                           self.max_predictions_per_seq)

    @property
    def metric_names(self):
        return ("mlm_loss", f"{self.pair}_loss", "mlm_accuracy", f"{self.pair}_accuracy")

    def _prepare_default(self):
        """Prepare the embedded Shakespeare corpus in this task's format once (cached)."""
        seq_length = self.train.seq_length or 128
        out = data.default_data_dir(seq_length=seq_length, vocab_size=8000) + "-" + self.format
        options = dataclasses.asdict(MaskingOptions(**self.masking_defaults))
        return data.prepare_locked(out, seq_length=seq_length, format=self.format,
                                   format_options=options)

    def _overrides(self):
        """The --num_layers/--hidden_size/--num_heads/--dropout overrides (None keeps) and
        --attention/--attention_block_size."""
        t = self.train
        return dict(num_layers=t.num_layers or None, hidden_size=t.hidden_size or None,
                    num_heads=t.num_heads or None,
                    dropout=t.dropout if t.dropout >= 0 else None, attention=t.attention,
                    attention_block_size=t.attention_block_size)

    def build_model(self):
        """The model, built (variables created) so it can be checkpointed and counted."""
        model = self._model_class(self.model_config, name=self.model_name)
        model.build()
        return model

    def dataset(self, split, batch_size, input_context=None, *, seed=0, repeat=True,
                shuffle=True, start=0, drop_remainder=True):
        """Batches of the seven standard features, int32 (float32 weights), for one pipeline."""
        batches = data.make_dataset(
            self.data_dir, split, batch_size, format=self.format, seq_length=self.seq_length,
            vocab_size=self.model_config.vocab_size, input_context=input_context, seed=seed,
            shuffle=shuffle, repeat=repeat, deterministic=self.train.deterministic,
            skip_corrupt=self.train.skip_corrupt, start=start,
            trace=getattr(self.train, "data_trace", "") if split == "train" else "",
            drop_remainder=drop_remainder)
        if self._masking is None or split != "train":
            return batches
        # Masks are drawn per batch of this pipeline (so they differ between layouts; the
        # examples do not): keyed by pipeline and by the global batch number.
        key = seed * 65536 + getattr(input_context, "input_pipeline_id", 0)
        first = start // (batch_size * getattr(input_context, "num_input_pipelines", 1))
        masking = self._masking
        return batches.enumerate(start=first).map(
            lambda index, batch: masking(batch, tf.stack([tf.constant(key, tf.int64), index])),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def flops_per_token(self):
        """Model training FLOPs per token at this task's seq_length (for MFU)."""
        return self.model_config.flops_per_token(self.seq_length)

    def model_inputs(self, batch):
        return {name: batch[name] for name in ("input_ids", "segment_ids", "input_mask",
                                               "masked_lm_positions")}

    def loss_from_outputs(self, outputs, batch):
        """MLM + sentence-pair loss in float32, and the metrics to average."""
        ids, weights = batch["masked_lm_ids"], tf.cast(batch["masked_lm_weights"], tf.float32)
        logits = tf.cast(outputs["mlm_logits"], tf.float32)  # (B, P, V)
        losses = self.vocab_cross_entropy(ids, logits)  # (B, P)
        count = tf.reduce_sum(weights) + 1e-5
        mlm_loss = tf.reduce_sum(losses * weights) / count
        hits = tf.cast(tf.equal(self.vocab_argmax(logits, ids.dtype), ids), tf.float32)
        labels = batch["next_sentence_labels"][:, 0]
        pair_logits = tf.cast(outputs[f"{self.pair}_logits"], tf.float32)  # (B, 2)
        pair_loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels,
                                                                                  pair_logits))
        pair_hits = tf.equal(tf.argmax(pair_logits, -1, output_type=labels.dtype), labels)
        loss = mlm_loss + pair_loss
        return loss, {"loss": loss, "mlm_loss": mlm_loss, f"{self.pair}_loss": pair_loss,
                      "mlm_accuracy": tf.reduce_sum(hits * weights) / count,
                      f"{self.pair}_accuracy": tf.reduce_mean(tf.cast(pair_hits, tf.float32))}

    def loss(self, model, batch, training=False):
        return self.loss_from_outputs(model(self.model_inputs(batch), training=training), batch)

    def validation_outputs(self, outputs, batch):
        """Per-sequence sums the metrics are ratios of: float32 (B,) each."""
        ids, weights = batch["masked_lm_ids"], tf.cast(batch["masked_lm_weights"], tf.float32)
        logits = tf.cast(outputs["mlm_logits"], tf.float32)  # (B, P, V)
        hits = tf.cast(tf.equal(self.vocab_argmax(logits, ids.dtype), ids), tf.float32)
        labels = batch["next_sentence_labels"][:, 0]
        pair_logits = tf.cast(outputs[f"{self.pair}_logits"], tf.float32)  # (B, 2)
        pair_hits = tf.equal(tf.argmax(pair_logits, -1, output_type=labels.dtype), labels)
        return {"mlm_loss_sum": tf.reduce_sum(self.vocab_cross_entropy(ids, logits) * weights, 1),
                "mlm_hits": tf.reduce_sum(hits * weights, 1),
                "mlm_weight": tf.reduce_sum(weights, 1),
                "pair_loss": tf.nn.sparse_softmax_cross_entropy_with_logits(labels, pair_logits),
                "pair_hit": tf.cast(pair_hits, tf.float32)}

    def validation_step(self, model, batch):
        """What the metric needs from one batch (single replica; the trainer gathers it)."""
        return self.validation_outputs(model(self.model_inputs(batch), training=False), batch)

    def reduce_aggregated_logs(self, outputs):
        """Validation loss, MLM and sentence-pair losses and accuracies over every gathered
        sequence (MLM figures per masked token of the whole split)."""
        count = float(outputs["mlm_weight"].sum()) + 1e-5
        mlm_loss = float(outputs["mlm_loss_sum"].sum()) / count
        pair_loss = float(outputs["pair_loss"].mean())
        return {"loss": mlm_loss + pair_loss, "mlm_loss": mlm_loss,
                f"{self.pair}_loss": pair_loss,
                "mlm_accuracy": float(outputs["mlm_hits"].sum()) / count,
                f"{self.pair}_accuracy": float(outputs["pair_hit"].mean())}

    def tokenizer(self):
        return data.load_tokenizer(self.manifest.tokenizer_path)


class DynamicMasking:
    """Re-mask a batch of standard ALBERT features: restore the original tokens, then choose
    round(masked_lm_prob x length) positions (at most max_predictions) among the real,
    non-special tokens and corrupt them 80% [MASK] / 10% random / 10% kept. Token level."""

    def __init__(self, vocab, masked_lm_prob, max_predictions):
        if not 0.0 < masked_lm_prob < 1.0:
            raise ValueError(f"--dynamic_masked_lm_prob={masked_lm_prob}: expected 0 < p < 1")
        self.masked_lm_prob = masked_lm_prob
        self.max_predictions = max_predictions
        self.cls_id, self.sep_id, self.mask_id = vocab.cls_id, vocab.sep_id, vocab.mask_id
        self.replacement_ids = tf.constant(vocab.replacement_ids, tf.int32)

    def __call__(self, batch, seed):
        """batch: a dict of (B, ...) features; seed: int64 (2,) stateless RNG seed."""
        ids = _restore(batch)  # (B, T)
        real = tf.cast(batch["input_mask"], tf.bool)
        candidate = real & tf.not_equal(ids, self.cls_id) & tf.not_equal(ids, self.sep_id)
        seeds = tf.random.experimental.stateless_split(seed, 3)  # (3, 2)
        scores = tf.where(candidate, tf.random.stateless_uniform(tf.shape(ids), seeds[0]), -1.0)
        top_scores, positions = tf.math.top_k(scores, self.max_predictions)  # (B, P)
        length = tf.reduce_sum(tf.cast(real, tf.float32), axis=1, keepdims=True)
        wanted = tf.maximum(1.0, tf.round(length * self.masked_lm_prob))
        keep = (tf.range(self.max_predictions, dtype=tf.float32)[None] < wanted) & (top_scores >= 0)
        positions = tf.sort(tf.where(keep, positions, tf.shape(ids)[1]), axis=1)  # real first
        keep = positions < tf.shape(ids)[1]
        positions = tf.where(keep, positions, 0)
        labels = tf.where(keep, tf.gather(ids, positions, batch_dims=1), 0)
        action = tf.random.stateless_uniform(tf.shape(positions), seeds[1])
        random_ids = tf.gather(self.replacement_ids, tf.random.stateless_uniform(
            tf.shape(positions), seeds[2], maxval=tf.size(self.replacement_ids), dtype=tf.int32))
        new = tf.where(action < 0.8, self.mask_id, tf.where(action < 0.9, random_ids, labels))
        weights = tf.cast(keep, tf.float32)
        return {**batch, "input_ids": _scatter(ids, positions, new, weights),
                "masked_lm_positions": positions, "masked_lm_ids": labels,
                "masked_lm_weights": weights}


def _scatter(ids, positions, values, weights):
    """ids with ids[b, positions[b, p]] = values[b, p] wherever weights[b, p] > 0."""
    hit = tf.one_hot(positions, tf.shape(ids)[1]) * weights[..., None]  # (B, P, T)
    placed = tf.einsum("bpt,bp->bt", hit, tf.cast(values, tf.float32))
    return tf.where(tf.reduce_sum(hit, axis=1) > 0, tf.cast(placed, ids.dtype), ids)


def _restore(batch):
    """The unmasked input_ids: the stored labels put back at their positions."""
    return _scatter(batch["input_ids"], batch["masked_lm_positions"], batch["masked_lm_ids"],
                    tf.cast(batch["masked_lm_weights"], tf.float32))
