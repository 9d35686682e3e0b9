"""`tfbig-classify`: fine-tune a converted BERT or a Llama-family run (tfbig-train --model=llama,
tfbig-convert of a Hugging Face one) on sentence or sentence-pair labels (GLUE-style) and
report accuracy, F1 and Matthews correlation: the Trainer running tfbig.tasks.classify.

    tfbig-classify --init_checkpoint=runs/bert-base --train_file=MNLI/train.tsv \\
        --eval_file=MNLI/dev_matched.tsv --text_a=sentence1 --text_b=sentence2 \\
        --label=gold_label --output_dir=runs/mnli

Data: TSV with a header row (GLUE's files) or JSON lines, one example per row/line; --text_b
empty for single sentences. Labels are the distinct values of the training file's --label
column, sorted. Or a TFDS dataset already prepared on disk (tfbig.data.glue; nothing is
downloaded): --tfds_name=glue/mnli --tfds_data_dir=DIR trains on its train split and scores
validation_matched and validation_mismatched.

Writes to --output_dir: eval_results.json (accuracy, f1, mcc; "SPLIT/accuracy"... for TFDS
splits), predictions.jsonl (predictions_SPLIT.jsonl: {"idx", "label"} per example, idx being
GLUE's example index), labels.json, train_losses.json (the loss of each logged step), and the
Trainer's run: config.json, the tokenizer (vocab.txt, tokenizer.json...), checkpoints (a rerun
of the command resumes from the last one), TensorBoard events (--eval_every: accuracy during
training).

Every tfbig-train backend and feature applies (tfbig.training.finetune): --strategy=horovod |
multiworker | mirrored | pipeline, --tensor_parallel, --zero_stage, --pipeline_stages,
--precision, --grad_accum_steps, --checkpoint_every, --deterministic, --elastic, profiling.
Prediction runs on every data-parallel rank, gathered in dataset order.

    horovodrun -np 2 -H localhost:2 --gloo tfbig-classify --strategy=horovod ...
    tfbig-launch --workers=2 -- tfbig-classify --strategy=multiworker ...
    tfbig-classify --strategy=pipeline --pipeline_stages=4 --num_microbatches=4 ...
"""
import dataclasses
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfbig.errors import UsageError  # noqa: E402
from tfbig.tasks.options import ClassifyData  # noqa: E402
from tfbig.training import finetune  # noqa: E402


@dataclasses.dataclass
class ClassifyOptions(ClassifyData, finetune.FineTuneOptions):
    """What to fine-tune, on which examples, and the recipe (tfbig-classify's flags)."""

    output_dir: str = finetune.field("runs/classify", "Run directory: predictions, scores, "
                                     "config.json and checkpoints (a rerun resumes).")


def fine_tune(options, before_fit=None, **overrides):
    """Train on --train_file (or --tfds_name), score the eval data; returns the scores dict
    (on the chief; {} elsewhere). `overrides`: other Trainer flags by name; `before_fit(trainer)`
    runs before training (tests record the reference's gradients)."""
    from tfbig.tasks.classify import ClassifyTask
    from tfbig.training.precision import precision_policy
    from tfbig.training.trainer import Trainer

    cfg = finetune.experiment(options, "classify", **overrides)
    with precision_policy(options.precision):  # the model computes in float16 / bfloat16
        strategy = finetune.strategy(cfg)
        task = ClassifyTask(cfg.train, options)
        finetune.set_steps(cfg, options, len(task.examples["train"]))
        logger = finetune.LossRecorder(options.output_dir, strategy.is_chief,
                                       cfg.train.max_steps)
        trainer = Trainer(cfg, strategy=strategy, task=task, logger=logger)
        if before_fit:
            before_fit(trainer)
        summary = trainer.fit()
        result = {} if summary.get("preempted") else _outputs(trainer, task, options, summary)
        chief = trainer.strategy.is_chief
        if chief:
            finetune.write_losses(trainer, logger, options)
        trainer.strategy.shutdown()  # every process waits for the chief's files
    return result if chief else {}


def _outputs(trainer, task, options, summary):
    """Predict every eval set on every rank; the chief writes labels, predictions, scores."""
    result = {}
    for number, name in enumerate(task.eval_names):  # the first was the final evaluation
        outputs = trainer.predictions if number == 0 else trainer.predict(name)
        scores = summary["eval"] if number == 0 else task.reduce_aggregated_logs(outputs)
        result.update({f"{name}/{k}" if name else k: v for k, v in scores.items()})
        if trainer.strategy.is_chief:
            _write_predictions(options.output_dir, name, task, outputs["logits"].argmax(-1))
    if trainer.strategy.is_chief:
        finetune.write_json(options.output_dir, "labels.json", task.names)
        if result:
            finetune.write_json(options.output_dir, "eval_results.json", result)
    return result


def _write_predictions(directory, split, task, predicted):
    suffix = f"_{split}" if split else ""
    with open(os.path.join(directory, f"predictions{suffix}.jsonl"), "w") as file:
        for (*_, idx), index in zip(task.examples[split], predicted):  # idx: GLUE's key
            file.write(json.dumps({"idx": idx, "label": task.names[index]}) + "\n")


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    own = [f.name for f in dataclasses.fields(ClassifyOptions)]
    options = ClassifyOptions(**{name: flags.FLAGS[name].value for name in own})
    overrides = finetune.overrides_from_flags(ClassifyOptions)
    for key, value in fine_tune(options, **overrides).items():
        print(f"{key}: {value:.4f}")


def run():
    from tfbig.commands import cli

    finetune.define_flags(ClassifyOptions)
    own = [f.name for f in dataclasses.fields(ClassifyOptions)]
    cli.run_app("tfbig-classify", main, __doc__, [
        ("classify", own), ("trainer", finetune.trainer_flags(ClassifyOptions))])


if __name__ == "__main__":
    run()
