"""`tfbig-squad`: fine-tune ALBERT, BERT or a Llama-family model on SQuAD v1.1/v2.0, predict,
and score officially: the Trainer running tfbig.tasks.squad.

    tfbig-squad --init_checkpoint=runs/albert --train_file=train-v2.0.json \\
        --predict_file=dev-v2.0.json --output_dir=runs/squad
    tfbig-squad --init_checkpoint=runs/albert --random_init ...   # same model, no pretraining

Writes to --output_dir: predictions.json ({id: answer}), null_odds.json (v2.0: null score
minus best span score per question), nbest_predictions.json, eval_results.json (exact, f1 and
for v2.0 HasAns/NoAns splits, best_f1 and the threshold used), train_losses.json,
squad_config.json (the model and tokenizer, read by a predict-only rerun) and the Trainer's run:
config.json, checkpoints (a rerun of the command resumes from the last one), TensorBoard events.
v2.0 answers "" when null_odds > --null_score_diff_threshold; unset, the threshold is the one
that maximises F1 on the predict file (the official evaluation's best_f1 search, as the
BERT/ALBERT papers report v2.0 dev scores). Without --train_file: predict with the model
fine-tuned earlier in --output_dir.

Every tfbig-train backend and feature applies (tfbig.training.finetune): --strategy=horovod |
multiworker | mirrored | pipeline, --tensor_parallel, --zero_stage=1|2|3, --pipeline_stages
(also across ranks, with --tensor_parallel), --precision, --grad_accum_steps,
--checkpoint_every, --deterministic, --dropout. Prediction runs on every data-parallel rank in
batches of the training micro-batch, gathered in dataset order. Refused by name:
--time_budget_minutes (the recipe's schedule needs the step count up front).

    horovodrun -np 4 -H localhost:4 --gloo tfbig-squad --strategy=horovod --zero_stage=2 ...
    tfbig-squad --strategy=pipeline --pipeline_stages=2 --num_microbatches=4 ...
"""
import dataclasses
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfbig.errors import UsageError  # noqa: E402
from tfbig.tasks.options import SquadData  # noqa: E402
from tfbig.training import finetune  # noqa: E402

OUTPUTS = {"predictions": "predictions.json", "nbest": "nbest_predictions.json",
           "null_odds": "null_odds.json", "scores": "eval_results.json"}


@dataclasses.dataclass
class SquadOptions(SquadData, finetune.FineTuneOptions):
    """What to fine-tune, on which SQuAD files, and the recipe (tfbig-squad's flags)."""

    output_dir: str = finetune.field("runs/squad", "Run directory: predictions, scores, "
                                     "config.json and checkpoints (a rerun resumes).")
    preset: str = finetune.field("small", "Without --init_checkpoint: ALBERT preset of a "
                                           "randomly initialised model (needs --tokenizer).")
    learning_rate: float = finetune.field(5e-5, "Peak AdamW learning rate.")
    num_train_epochs: float = finetune.field(2.0, "Epochs over the training features.")
    log_every: int = finetune.field(50, "Log the training loss every N steps.")


def model_config_and_tokenizer(options):
    """(config, tokenizer): the fine-tuned model of --output_dir (no --train_file), else
    --init_checkpoint's, else a random ALBERT --preset with --tokenizer."""
    from tfbig.models.albert import AlbertConfig
    from tfbig.tasks.squad_model import pretrained_config, read_model_dir, sentencepiece_tokenizer

    if not options.train_file:
        saved = os.path.join(options.output_dir, "squad_config.json")
        with open(saved) as file:
            return read_model_dir(options.output_dir, json.load(file), flag="--output_dir")
    if options.init_checkpoint:
        return pretrained_config(options.init_checkpoint)
    if not options.tokenizer:
        raise UsageError("give --init_checkpoint (a tfbig-train ALBERT run), --tokenizer "
                         "(with --preset, for a randomly initialised model), or an "
                         "--output_dir holding a fine-tuned model")
    tokenizer = sentencepiece_tokenizer(options.tokenizer)
    return AlbertConfig.from_preset(options.preset, vocab_size=tokenizer.vocab_size,
                                    seq_length=max(options.max_seq_length, 128)), tokenizer


def fine_tune(options, before_fit=None, **overrides):
    """Train on --train_file (unless predicting only), predict and score --predict_file;
    returns the scores (on the chief; {} elsewhere). `overrides`: other Trainer flags;
    `before_fit(trainer)` runs before training (tests record the reference's gradients)."""
    from tfbig.tasks.squad import SquadTask
    from tfbig.training.precision import precision_policy
    from tfbig.training.trainer import Trainer

    if not options.train_file:  # the fine-tuned weights come from --output_dir's checkpoint
        options = dataclasses.replace(options, init_checkpoint="", max_steps=_saved_steps(
            options.output_dir))
    cfg = finetune.experiment(options, "squad", **overrides)
    with precision_policy(options.precision):  # the model computes in float16 / bfloat16
        strategy = finetune.strategy(cfg)  # before any TensorFlow op (MultiWorkerMirrored)
        config, tokenizer = model_config_and_tokenizer(options)
        task = SquadTask(cfg.train, options, config, tokenizer)
        train = task.manifest.splits.get("train")
        finetune.set_steps(cfg, options, train.records if train else 0)
        logger = finetune.LossRecorder(options.output_dir, strategy.is_chief,
                                       cfg.train.max_steps)
        trainer = Trainer(cfg, strategy=strategy, task=task, logger=logger)
        if before_fit:
            before_fit(trainer)
        if options.train_file:
            summary = trainer.fit()
        else:
            summary = {"eval": trainer.evaluate()}
        scores = {} if summary.get("preempted") else _outputs(trainer, task, options)
        chief = trainer.strategy.is_chief
        if chief and options.train_file:
            finetune.write_losses(trainer, logger, options)
            _write_model(options, config, tokenizer, int(trainer.step.numpy()))
        trainer.strategy.shutdown()  # every process waits for the chief's files
    return scores if chief else {}


def _saved_steps(output_dir):
    """The steps of the model fine-tuned in `output_dir` (what a predict-only run restores)."""
    path = os.path.join(output_dir, "squad_config.json")
    if not os.path.isfile(path):
        raise UsageError(f"no --train_file and no fine-tuned model in --output_dir="
                         f"{output_dir}; give a --train_file")
    with open(path) as file:
        return json.load(file)["steps"]


def _outputs(trainer, task, options):
    """The chief writes predictions, n-best, null odds and scores of the final prediction."""
    if not options.predict_file:
        return {}
    result = task.result  # of the final evaluation's reduce_aggregated_logs, on every rank
    if trainer.strategy.is_chief:
        for key, name in OUTPUTS.items():
            if key in result:
                finetune.write_json(options.output_dir, name, result[key])
    return result.get("scores", {})


def _write_model(options, config, tokenizer, steps):
    """squad_config.json: what a predict-only rerun reads (the Trainer copied the tokenizer)."""
    from tfbig.data.tokenizer import run_tokenizer_files
    from tfbig.tasks.fine_tuning import tokenizer_path
    from tfbig.tasks.squad_model import family_of

    finetune.write_json(options.output_dir, "squad_config.json", {
        "model_format": family_of(config),
        "tokenizer": run_tokenizer_files(tokenizer_path(tokenizer))[1],
        "model_config": dataclasses.asdict(config), "steps": steps,
        "options": {k: None if v != v else v  # NaN (unset) is not JSON
                    for k, v in dataclasses.asdict(options).items()}})


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    own = [f.name for f in dataclasses.fields(SquadOptions)]
    options = SquadOptions(**{name: flags.FLAGS[name].value for name in own})
    overrides = finetune.overrides_from_flags(SquadOptions)
    for key, value in fine_tune(options, **overrides).items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


def run():
    from tfbig.commands import cli

    finetune.define_flags(SquadOptions)
    own = [f.name for f in dataclasses.fields(SquadOptions)]
    cli.run_app("tfbig-squad", main, __doc__, [
        ("squad", own), ("trainer", finetune.trainer_flags(SquadOptions))])


if __name__ == "__main__":
    run()
