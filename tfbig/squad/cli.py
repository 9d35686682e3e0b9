"""`tfbig-squad`: fine-tune ALBERT or BERT on SQuAD v1.1/v2.0, predict, and score officially.

    tfbig-squad --init_checkpoint=runs/albert --train_file=train-v2.0.json \\
        --predict_file=dev-v2.0.json --output_dir=runs/squad
    tfbig-squad --init_checkpoint=runs/albert --random_init ...   # same model, no pretraining

Writes to --output_dir: predictions.json ({id: answer}), null_odds.json (v2.0: null score
minus best span score per question), nbest_predictions.json, eval_results.json (exact, f1 and
for v2.0 HasAns/NoAns splits, best_f1 and the threshold used), the fine-tuned checkpoint and
squad_config.json. v2.0 answers "" when null_odds > --null_score_diff_threshold; unset, the
threshold is the one that maximises F1 on the predict file (the official evaluation's
best_f1 search, as the BERT/ALBERT papers report v2.0 dev scores).

Every flag is a field of `SquadOptions`. On Horovod the model may be split or sharded too
(--tensor_parallel, --zero_stage=1|2|3; tfbig.distribute.finetune_parallel):

    horovodrun -np 4 -H localhost:4 --gloo tfbig-squad --strategy=horovod --tensor_parallel=2 ...

or pipelined over this process's devices, the span head and its loss on the last stage
(--strategy=pipeline --pipeline_stages --num_microbatches --schedule;
tfbig.distribute.finetune_pipeline):

    tfbig-squad --strategy=pipeline --pipeline_stages=2 --num_microbatches=4 ...
"""
import dataclasses
import json
import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfbig.config import field  # noqa: E402
from tfbig.distribute.finetune_parallel import ParallelOptions  # noqa: E402
from tfbig.distribute.finetune_pipeline import PipelineOptions  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402


@dataclasses.dataclass
class SquadOptions(PipelineOptions, ParallelOptions):
    """What to fine-tune, on which SQuAD files, and how (and how Horovod or the pipeline
    splits it)."""

    train_file: str = field("", "SQuAD JSON (v1.1 or v2.0) to fine-tune on; empty: predict only, "
                                "with the model fine-tuned earlier in --output_dir.")
    predict_file: str = field("", "SQuAD JSON to predict (and score, if it has answers).")
    output_dir: str = field("runs/squad", "Where predictions, scores and the fine-tuned "
                                          "checkpoint go.")
    init_checkpoint: str = field("", "A tfbig-train --model=albert --model_dir or a "
                                     "tfbig-convert --output_dir (BERT or ALBERT): its config, "
                                     "tokenizer and latest checkpoint initialise the backbone.")
    random_init: bool = field(False, "Take --init_checkpoint's config and tokenizer but start "
                                     "from random weights (the no-pretraining baseline).")
    preset: str = field("small", "Without --init_checkpoint: ALBERT preset of a randomly "
                                 "initialised model (needs --tokenizer).")
    tokenizer: str = field("", "Without --init_checkpoint: the SentencePiece .model to use.")
    version: str = field("auto", "SQuAD version: auto (from the files) | 1.1 | 2.0.")
    max_seq_length: int = field(384, "Tokens per feature: [CLS] question [SEP] context [SEP].")
    doc_stride: int = field(128, "Tokens between the starts of a long context's windows.")
    max_query_length: int = field(64, "Question tokens kept.")
    max_answer_length: int = field(30, "Longest answer, in tokens.")
    n_best_size: int = field(20, "Start and end candidates per window; answers kept per "
                                 "question in nbest_predictions.json.")
    null_score_diff_threshold: float = field(float("nan"), "v2.0: answer '' when the null score "
                                             "minus the best span score is above this; unset: "
                                             "tuned for F1 on --predict_file.")
    train_batch_size: int = field(32, "Features per training step.")
    predict_batch_size: int = field(64, "Features per prediction batch.")
    learning_rate: float = field(5e-5, "Peak AdamW learning rate.")
    num_train_epochs: float = field(2.0, "Epochs over the training features.")
    max_steps: int = field(0, "Training steps (0: from --num_train_epochs).")
    warmup_proportion: float = field(0.1, "Share of steps of linear warmup.")
    weight_decay: float = field(0.01, "AdamW weight decay (not on LayerNorm, biases, "
                                      "embeddings).")
    dropout: float = field(-1.0, "Override the model's dropout (negative keeps it).")
    seed: int = field(0, "Seed for the span head, dropout and data order.")
    xla: bool = field(True, "Compile the training and prediction steps with XLA.")
    log_every: int = field(50, "Log the training loss every N steps.")
    strategy: str = field("single", "single (one process) | horovod (one process per device, "
                                    "started by horovodrun) | multiworker (MultiWorkerMirrored, "
                                    "TF_CONFIG) | pipeline (stages on this process's "
                                    "devices); --train_batch_size is global.")
    precision: str = field("fp32", "fp32 | mixed_float16 (dynamic loss scaling, as tfbig-train; "
                                   "a step with non-finite gradients is skipped) | "
                                   "mixed_bfloat16.")


def define_flags():
    definers = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                float: flags.DEFINE_float, str: flags.DEFINE_string}
    for f in dataclasses.fields(SquadOptions):
        if f.name not in flags.FLAGS:
            definers[f.type](f.name, f.default, f.metadata["help"])


def _model_config_and_tokenizer(options):
    from tfbig.models.albert import AlbertConfig
    from tfbig.squad.finetune import pretrained_config, read_model_dir, sentencepiece_tokenizer

    saved = os.path.join(options.output_dir, "squad_config.json")
    if not options.train_file and os.path.isfile(saved):  # predict with a fine-tuned model
        with open(saved) as file:
            content = json.load(file)
        config, tokenizer = read_model_dir(options.output_dir, {
            "model_format": "albert", **content}, flag="--output_dir")
    elif options.init_checkpoint:
        config, tokenizer = pretrained_config(options.init_checkpoint)
    else:
        if not options.tokenizer:
            raise ValueError("give --init_checkpoint (a tfbig-train ALBERT run), --tokenizer "
                             "(with --preset, for a randomly initialised model), or an "
                             "--output_dir holding a fine-tuned model")
        tokenizer = sentencepiece_tokenizer(options.tokenizer)
        config = AlbertConfig.from_preset(options.preset, vocab_size=tokenizer.vocab_size,
                                          seq_length=max(options.max_seq_length, 128))
    if options.dropout >= 0:
        config = dataclasses.replace(config, dropout=options.dropout)
    config.check_inputs(seq_length=options.max_seq_length)
    return config, tokenizer


def _save_tokenizer(tokenizer, output_dir):
    """Copy the tokenizer beside the fine-tuned model; its entry for squad_config.json."""
    if hasattr(tokenizer, "vocab_file"):  # WordPiece (BERT)
        shutil.copyfile(tokenizer.vocab_file, os.path.join(output_dir, "vocab.txt"))
        return {"vocab_file": "vocab.txt", "lowercase": tokenizer.lowercase}
    shutil.copyfile(tokenizer.path, os.path.join(output_dir, "tokenizer.model"))
    return {"vocab_file": "tokenizer.model"}


def _read(path, version, tokenizer, options):
    from tfbig.squad.features import convert_examples, read_squad

    examples, found = read_squad(path)
    if version not in ("auto", found):
        raise ValueError(f"{path} is SQuAD {found} but --version={version}")
    features = convert_examples(examples, tokenizer, options.max_seq_length, options.doc_stride,
                                options.max_query_length)
    print(f"{path}: SQuAD {found}, {len(examples)} questions, {len(features)} features")
    return examples, features, found


def _write_json(directory, name, content):
    with open(os.path.join(directory, name), "w", encoding="utf-8") as file:
        json.dump(content, file, indent=1, ensure_ascii=False)


def fine_tune(options):
    """Train and/or predict as `options` say; returns the scores dict (or {} if none)."""
    from tfbig.distribute.finetune import precision_policy

    with precision_policy(options.precision):  # the model computes in float16 / bfloat16
        return _fine_tune(options)


def _fine_tune(options):
    import tensorflow as tf

    from tfbig.squad import finetune

    from tfbig.distribute import finetune_parallel
    from tfbig.distribute.finetune import fine_tune_strategy, write_checkpoint

    if options.strategy != "single" and not options.train_file:
        raise ValueError(f"--strategy={options.strategy} needs a --train_file (prediction runs "
                         "in one process)")
    strategy = fine_tune_strategy(options.strategy, "tfbig-squad", options,
                                  "" if options.random_init else options.init_checkpoint)
    config, tokenizer = _model_config_and_tokenizer(options)
    os.makedirs(options.output_dir, exist_ok=True)
    checkpoint_prefix = os.path.join(options.output_dir, "finetuned")
    if options.train_file:
        init = None if options.random_init else options.init_checkpoint or None
        with strategy.scope():  # tf.distribute: mirrored; --tensor_parallel: split; pipeline
            model = finetune_parallel.build_model(
                strategy, lambda: finetune.build_model(config, init, seed=options.seed),
                options.max_seq_length, config, finetune.span_loss)
        _, features, _ = _read(options.train_file, options.version, tokenizer, options)
        losses = finetune.train(
            model, features, options.train_batch_size, options.num_train_epochs,
            options.learning_rate, options.warmup_proportion, options.weight_decay,
            options.max_steps, options.seed, options.xla, options.log_every,
            log=print if strategy.is_chief else None, strategy=strategy)
        print(f"{len(losses)} steps on {strategy.num_replicas} replica(s) (rank "
              f"{strategy.rank})")
        model = finetune_parallel.assembled_model(strategy, model)  # TP, pipeline: one device
        write_checkpoint(strategy, model, options.output_dir)  # collective under tf.distribute
        if not strategy.is_chief:
            strategy.shutdown()  # wait for the chief, then stop
            return {}
        _write_json(options.output_dir, "train_losses.json", losses)
        _write_json(options.output_dir, "squad_config.json",
                    {"model_format": finetune.family_of(config),
                     "tokenizer": _save_tokenizer(tokenizer, options.output_dir),
                     "model_config": dataclasses.asdict(config),
                     "options": {k: None if v != v else v  # NaN (unset) is not JSON
                                 for k, v in dataclasses.asdict(options).items()}})
    else:
        model = finetune.build_model(config)
        if not tf.io.gfile.exists(checkpoint_prefix + ".index"):
            raise ValueError(f"no --train_file and no fine-tuned model in --output_dir="
                             f"{options.output_dir}; give a --train_file")
        finetune.restore_model(model, checkpoint_prefix)
    scores = predict_and_score(model, tokenizer, options) if options.predict_file else {}
    strategy.shutdown()  # Horovod: the chief is done; every process stops together
    return scores


def predict_and_score(model, tokenizer, options):
    """Write predictions for --predict_file and return the official scores."""
    import math

    from tfbig.squad import evaluate, finetune, postprocess

    examples, features, version = _read(options.predict_file, options.version, tokenizer,
                                        options)
    starts, ends = finetune.predict(model, features, options.predict_batch_size, options.xla)
    answers, diffs, nbest = postprocess.best_spans(examples, features, starts, ends,
                                                   options.n_best_size, options.max_answer_length)
    with open(options.predict_file, encoding="utf-8") as file:
        dataset = json.load(file)
    has_answers = any(not e.is_impossible for e in examples)
    scores = {}
    if version == "2.0":
        threshold = options.null_score_diff_threshold
        if math.isnan(threshold):
            threshold, best_f1 = evaluate.tune_null_threshold(dataset, answers, diffs)
            scores["best_f1"] = best_f1
        predictions = postprocess.apply_null_threshold(answers, diffs, threshold)
        scores["null_score_diff_threshold"] = threshold
        _write_json(options.output_dir, "null_odds.json",
                    {qid: min(diff, 1e9) for qid, diff in diffs.items()})
    else:
        predictions = answers
    _write_json(options.output_dir, "predictions.json", predictions)
    _write_json(options.output_dir, "nbest_predictions.json", nbest)
    if has_answers:
        scores = {**evaluate.evaluate(dataset, predictions, version), **scores}
        _write_json(options.output_dir, "eval_results.json", scores)
    return scores


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    options = SquadOptions(**{f.name: flags.FLAGS[f.name].value
                              for f in dataclasses.fields(SquadOptions)})
    scores = fine_tune(options)
    for key, value in scores.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


def run():
    from tfbig import cli

    define_flags()
    parallel = [f.name for f in dataclasses.fields(ParallelOptions)]
    pipeline = [f.name for f in dataclasses.fields(PipelineOptions)]
    cli.run_app("tfbig-squad", main, __doc__, [
        ("squad", [f.name for f in dataclasses.fields(SquadOptions)
                   if f.name not in parallel + pipeline]),
        ("parallel", parallel), ("pipeline", pipeline)])


if __name__ == "__main__":
    run()
