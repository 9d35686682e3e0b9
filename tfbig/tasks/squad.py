"""SQuAD v1.1 / v2.0 extractive question answering as a task of the one Trainer.

The single-replica view, like tasks.classify: the examples (SQuAD JSON -> windowed features:
tfbig.data.squad.features), the model (ALBERT, BERT or a Llama with a span head: the backbone
of --init_checkpoint, or random with --random_init; tfbig.tasks.squad_model), the loss (mean of the start
and end cross-entropies over positions, BERT's), and a validation step returning start/end logits
with each feature's index. The metric runs once over the gathered outputs: n-best spans, the v2.0
null threshold (given, or tuned for F1 on the predict file) and the official EM/F1
(tfbig.data.squad.postprocess, tfbig.data.squad.evaluate).

Splits: "train" (--train_file's features) and "validation" (--predict_file's, with each
feature's index). The inputs, training order and steps around the loss are every fine-tuning
task's (tasks.fine_tuning).

    # SquadData: tfbig.tasks.options
    task = SquadTask(train_config, SquadData(init_checkpoint="runs/albert",
                                             train_file="train-v2.0.json",
                                             predict_file="dev-v2.0.json"))
"""
import json
import math

import numpy as np
import tensorflow as tf

from tfbig.errors import UsageError
from tfbig.models.llama_config import LlamaConfig
from tfbig.tasks.fine_tuning import INPUTS, Examples, FineTuningTask, tokenizer_path

LABELS = ("start_positions", "end_positions")


class SquadTask(FineTuningTask):
    """Span fine-tuning of ALBERT, BERT or a Llama on SQuAD features. `config` and
    `tokenizer` are the model's (tfbig.tasks.squad_model.pretrained_config, or a random ALBERT
    preset's)."""

    format = "squad"

    def __init__(self, train, options, config, tokenizer):
        from tfbig.data.squad.features import read_squad

        self.train, self.options, self._tokenizer = train, options, tokenizer
        self.set_model_config(config, options.max_seq_length)
        self.features, self.arrays = {}, {}
        if options.train_file:
            _, features, _ = self._read(options.train_file, read_squad)
            self.arrays["train"] = {k: features.arrays[k] for k in INPUTS + LABELS}
        if options.predict_file:
            self.examples, self.features, self.version = self._read(options.predict_file,
                                                                    read_squad)
            with open(options.predict_file, encoding="utf-8") as file:
                self.dataset_json = json.load(file)
            self.arrays["validation"] = {  # labels of the first gold answer: the pipeline's
                **{k: self.features.arrays[k] for k in INPUTS + LABELS},  # last stage reads them
                "feature_index": np.arange(len(self.features), dtype=np.int32)}
        self.manifest = Examples(tokenizer_path(tokenizer),
                                 {k: len(v["input_ids"]) for k, v in self.arrays.items()})

    def _read(self, path, read_squad):
        from tfbig.data.squad.features import convert_examples

        o = self.options
        examples, found = read_squad(path)
        if o.version not in ("auto", found):
            raise UsageError(f"{path} is SQuAD {found} but --version={o.version}")
        special = None  # [CLS] and [SEP]; a decoder's end-of-document token in both places
        if isinstance(self.model_config, LlamaConfig):
            special = (self._tokenizer.eos_id,) * 2
        features = convert_examples(examples, self._tokenizer, o.max_seq_length, o.doc_stride,
                                    o.max_query_length, special)
        print(f"{path}: SQuAD {found}, {len(examples)} questions, {len(features)} features")
        return examples, features, found

    def build_model(self):
        """The QA model, built: its backbone from --init_checkpoint (unless --random_init), its
        span head fresh."""
        from tfbig.tasks.squad_model import build_model

        init = None if self.options.random_init else self.options.init_checkpoint or None
        return build_model(self.model_config, init, seed=self.train.seed)

    def loss_from_outputs(self, outputs, batch):
        """Mean of the start and end cross-entropies over positions (float32)."""
        start, end = (tf.nn.sparse_softmax_cross_entropy_with_logits(
            batch[label], tf.cast(outputs[name], tf.float32))
            for label, name in zip(LABELS, ("start_logits", "end_logits")))
        loss = tf.reduce_mean(start + end) / 2.0
        return loss, {"loss": loss}

    def validation_outputs(self, outputs, batch):
        return {"start_logits": tf.cast(outputs["start_logits"], tf.float32),
                "end_logits": tf.cast(outputs["end_logits"], tf.float32),
                "feature_index": batch["feature_index"]}

    def answers(self, outputs):
        """{predictions, nbest, null_odds (v2.0), scores} of the gathered logits: the best
        spans, the null threshold applied (v2.0) and, if the file has answers, the official
        scores."""
        from tfbig.data.squad import evaluate, postprocess

        order = np.argsort(outputs["feature_index"], kind="stable")  # dataset order already
        o = self.options
        answers, diffs, nbest = postprocess.best_spans(
            self.examples, self.features, outputs["start_logits"][order],
            outputs["end_logits"][order], o.n_best_size, o.max_answer_length)
        result, scores = {"predictions": answers, "nbest": nbest}, {}
        if self.version == "2.0":
            threshold = o.null_score_diff_threshold
            if math.isnan(threshold):
                threshold, scores["best_f1"] = evaluate.tune_null_threshold(
                    self.dataset_json, answers, diffs)
            result["predictions"] = postprocess.apply_null_threshold(answers, diffs, threshold)
            scores["null_score_diff_threshold"] = threshold
            result["null_odds"] = {qid: min(diff, 1e9) for qid, diff in diffs.items()}
        if any(not e.is_impossible for e in self.examples):
            scores = {**evaluate.evaluate(self.dataset_json, result["predictions"],
                                          self.version), **scores}
            result["scores"] = scores
        self.result = result  # what tfbig-squad writes
        return result

    def reduce_aggregated_logs(self, outputs):
        """EM, F1 (v2.0: HasAns/NoAns, best_f1, the threshold) of the gathered logits; {}
        for a predict file without answers."""
        return self.answers(outputs).get("scores", {})
