"""Fine-tuning curve on the embedded QA set: scores every --eval_every steps, not only at the end.

Fine-tunes ALBERT as tfbig-squad does (same features, loss, AdamW schedule, seed) and every
--eval_every steps scores the held-out dev file (official SQuAD 2.0 evaluation, null threshold
tuned on it as tfbig-squad does; HasAns_f1_never_null: the best spans alone, never "no
answer") and the first --train_questions training questions (does the model fit what it
trains on, or not even that?). One JSON line per evaluation, with the
CPU-minutes spent training so far (process CPU time, evaluations excluded), the load average
and the CPU model; the last line is the run's result.

    python benchmarks/squad_curve.py --tokenizer=runs/albert-data/tokenizer.model \\
        --train_file=runs/qa/shakespeare-qa-v2.0-train.json \\
        --predict_file=runs/qa/shakespeare-qa-v2.0-dev.json --max_steps=8000 --eval_every=1000
    python benchmarks/squad_curve.py --init_checkpoint=runs/albert ...   # a pretrained backbone
    python benchmarks/squad_curve.py ... --also_score=finds=dev-finds.json:0   # another file, whole

--also_score=NAME=FILE[:N] scores the first N questions of another SQuAD v2.0 file (all with N 0
or no N) at each evaluation, under NAME: e.g. one question type of a mixed training set.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import json
import os
import resource
import time


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_model():
    with open("/proc/cpuinfo") as file:
        return next((line.split(":", 1)[1].strip() for line in file
                     if line.startswith("model name")), "unknown")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train_file", required=True, help="SQuAD v2.0 JSON to fine-tune on")
    parser.add_argument("--predict_file", required=True, help="SQuAD v2.0 JSON to score")
    parser.add_argument("--init_checkpoint", default="",
                        help="a tfbig-train --model=albert run; empty: random init")
    parser.add_argument("--tokenizer", default="", help="without --init_checkpoint")
    for name, default in (("embedding_size", 64), ("hidden_size", 64), ("num_layers", 2),
                          ("num_groups", 2), ("num_heads", 2)):
        parser.add_argument(f"--{name}", type=int, default=default,
                            help="random init: the model's shape")
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--doc_stride", type=int, default=64)
    parser.add_argument("--max_query_length", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--warmup_proportion", type=float, default=0.1)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--max_steps", type=int, default=2000)
    parser.add_argument("--eval_every", type=int, default=500)
    parser.add_argument("--train_questions", type=int, default=1000)
    parser.add_argument("--also_score", action="append", default=[], metavar="NAME=FILE[:N]",
                        help="another SQuAD v2.0 file scored at each evaluation (its first N "
                             "questions; all without N or with 0)")
    parser.add_argument("--dropout", type=float, default=-1.0,
                        help="the model's dropout in training (negative keeps the config's)")
    args = parser.parse_args()
    also = []
    for entry in args.also_score:
        name, _, rest = entry.partition("=")
        path, _, count = rest.partition(":")
        if name in ("train", "dev", "train_subset") or not name or not path \
                or not (count or "0").isdigit():
            parser.error(f"--also_score={entry}: expected NAME=FILE or NAME=FILE:N, NAME not "
                         "train, dev or train_subset")
        also.append((name, path, int(count or 0)))
    args.also = also
    if not args.init_checkpoint and not args.tokenizer:
        parser.error("give --init_checkpoint (a pretrained run) or --tokenizer (random init)")
    if args.eval_every < 1 or args.max_steps < 1:
        parser.error(f"--eval_every={args.eval_every} and --max_steps={args.max_steps}: "
                     "expected 1 or more")
    return args


def main():
    args = parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfbig.data import Tokenizer
    from tfbig.models.albert import AlbertConfig
    from tfbig.data.squad import evaluate, postprocess
    from tfbig.tasks.squad_model import pretrained_config
    from tfbig.data.squad.features import convert_examples, examples_from_dataset, first_questions

    if args.init_checkpoint:
        config, tokenizer = pretrained_config(args.init_checkpoint)
    else:
        tokenizer = Tokenizer.load(args.tokenizer)
        config = AlbertConfig(
            vocab_size=tokenizer.vocab_size, embedding_size=args.embedding_size,
            hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_groups=args.num_groups, num_heads=args.num_heads,
            seq_length=max(128, args.max_seq_length))
    if args.dropout >= 0:
        import dataclasses
        config = dataclasses.replace(config, dropout=args.dropout)
    sets = {}
    for name, path, count in (("train", args.train_file, 0),
                              ("dev", args.predict_file, 0),
                              ("train_subset", args.train_file, args.train_questions),
                              *args.also):
        with open(path, encoding="utf-8") as file:
            dataset = json.load(file)
        dataset = first_questions(dataset, count) if count else dataset
        examples = examples_from_dataset(dataset, path)
        sets[name] = (dataset, examples, convert_examples(
            examples, tokenizer, args.max_seq_length, args.doc_stride, args.max_query_length))
    import tempfile

    import numpy as np

    from tfbig.training import finetune as recipe
    from tfbig.commands.squad import SquadOptions
    from tfbig.tasks.squad_model import INPUTS
    from tfbig.tasks.squad import LABELS, SquadTask
    from tfbig.training.trainer import Trainer

    options = SquadOptions(  # the Trainer running tfbig.tasks.squad, as tfbig-squad does
        train_file=args.train_file, predict_file=args.predict_file,
        init_checkpoint=args.init_checkpoint, max_seq_length=args.max_seq_length,
        doc_stride=args.doc_stride, max_query_length=args.max_query_length,
        train_batch_size=args.batch_size, learning_rate=args.learning_rate,
        warmup_proportion=args.warmup_proportion, weight_decay=args.weight_decay,
        max_steps=args.max_steps, log_every=args.eval_every,
        output_dir=tempfile.mkdtemp(prefix="squad_curve_"))
    cfg = recipe.experiment(options, "squad", dropout=args.dropout)
    task = SquadTask(cfg.train, options, config, tokenizer)
    for name, (_, _, features) in sets.items():  # every set a split the Trainer predicts
        task.arrays[name] = {**{k: features.arrays[k] for k in INPUTS + LABELS},
                             "feature_index": np.arange(len(features), dtype=np.int32)}
        task.manifest.splits[name] = type(task.manifest.splits["train"])(len(features))
    recipe.set_steps(cfg, options, len(sets["train"][2]))
    trainer = Trainer(cfg, task=task)

    def score(name):
        dataset, examples, features = sets[name]
        outputs = trainer.predict(name)  # every replica's rows, gathered in dataset order
        starts, ends = outputs["start_logits"], outputs["end_logits"]
        answers, diffs, _ = postprocess.best_spans(examples, features, starts, ends)
        threshold, _ = evaluate.tune_null_threshold(dataset, answers, diffs)
        scores = evaluate.evaluate(dataset, postprocess.apply_null_threshold(
            answers, diffs, threshold), "2.0")
        spans = evaluate.evaluate(dataset, postprocess.apply_null_threshold(
            answers, diffs, float("inf")), "2.0")  # never "no answer": the best spans alone
        return {**{k: round(scores[k], 1) for k in ("f1", "HasAns_f1", "NoAns_f1")},
                "HasAns_f1_never_null": round(spans["HasAns_f1"], 1)}

    state = {"evaluations": 0, "eval_cpu": 0.0, "start_cpu": cpu_seconds(),
             "start": time.perf_counter()}

    def evaluate_now(summary):  # every eval_every steps and at the end
        state["evaluations"] += 1
        before = cpu_seconds()
        result = {
            "step": summary["step"], "train_loss": summary["train"].get("loss"),
            "train_cpu_minutes": round((before - state["start_cpu"] - state["eval_cpu"]) / 60, 2),
            "wall_minutes": round((time.perf_counter() - state["start"]) / 60, 1),
            "dev": score("dev"), f"train_first_{args.train_questions}": score("train_subset"),
            **{name: score(name) for name, _, _ in args.also},
            "load_average": [round(x, 1) for x in os.getloadavg()], "cpu": cpu_model()}
        state["eval_cpu"] += cpu_seconds() - before
        _record.emit(result, "squad_curve")  # one line per evaluation: the curve

    print(json.dumps({"config": vars(args), "train_features": len(sets["train"][2]),
                      "dev_features": len(sets["dev"][2])}), flush=True)
    while int(trainer.step.numpy()) < args.max_steps:
        evaluate_now(trainer.fit(steps=args.eval_every))


if __name__ == "__main__":
    main()
