"""SQuAD prediction on 2 Horovod ranks vs 1: tfbig-squad's evaluation (every rank predicts its
share of the features, the logits gathered in dataset order, then n-best spans and the official
EM/F1 once) timed with one process and with `horovodrun -np 2`.

Strong scaling: the same predict file (--questions synthetic SQuAD 1.1 questions over 10-word
contexts) and the same random BERT (--hidden_size, --num_layers, --max_seq_length) on both
sides, one intra-op and one inter-op thread per process (as the scaling benchmarks), so the
2-rank run has twice the compute. Each side builds its Trainer, evaluates once (compiling the
validation step), then times --repeats more evaluations; the fastest counts (other load only
ever slows a run). ratio = seconds on 2 ranks / seconds on 1 (goal <= 0.6; 0.5 is perfect).

    python benchmarks/squad_predict.py --questions=512 --record

Prints one JSON line last: the seconds of each, the ratio, the CPU and the load average.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
WORDS = [f"w{i}" for i in range(40)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what"] + WORDS


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=512)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32, help="global predict batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("FILES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="single", help=argparse.SUPPRESS)  # a worker's
    return parser.parse_args()


def write_files(root, args):
    """A random BERT run directory (tfbig-convert's layout) and the synthetic predict file."""
    import keras
    import numpy as np

    from tfbig.checkpoints.checkpoint import model_variables
    from tfbig.convert import run_dir
    from tfbig.models.bert import BertConfig, BertForPretraining

    with open(os.path.join(root, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=args.hidden_size,
                        num_heads=max(1, args.hidden_size // 64), num_layers=args.num_layers,
                        intermediate_size=4 * args.hidden_size, seq_length=args.max_seq_length)
    keras.utils.set_random_seed(0)
    model = BertForPretraining(config)
    model.build()
    run_dir.write(os.path.join(root, "run"), config, {k: v.numpy() for k, v in
                                                      model_variables(model).items()},
                  os.path.join(root, "vocab.txt"), True, "benchmark")
    rng, paragraphs = np.random.default_rng(0), []
    for i in range(args.questions):
        words = list(rng.choice(WORDS, 10))
        paragraphs.append({"context": " ".join(words), "qas": [{
            "id": f"q{i}", "question": "what " + " ".join(words[:3]),
            "answers": [{"text": " ".join(words[3:5]),
                         "answer_start": len(" ".join(words[:3])) + 1}]}]})
    with open(os.path.join(root, "dev.json"), "w") as f:
        json.dump({"version": "1.1", "data": [{"title": "w", "paragraphs": paragraphs}]}, f)


def worker(root, out, args, strategy):
    """Build tfbig-squad's Trainer on the predict file; time evaluations after the first."""
    from tfbig.training import finetune
    from tfbig.commands.squad import SquadOptions
    from tfbig.tasks.squad_model import pretrained_config
    from tfbig.tasks.squad import SquadTask
    from tfbig.training.trainer import Trainer

    options = SquadOptions(init_checkpoint=os.path.join(root, "run"),
                           predict_file=os.path.join(root, "dev.json"), train_file="",
                           max_seq_length=args.max_seq_length, doc_stride=32,
                           max_query_length=8, train_batch_size=args.batch_size, xla=True,
                           strategy=strategy, output_dir=os.path.join(root, strategy))
    cfg = finetune.experiment(options, "squad", peak_tflops=1.0)
    cfg.train.max_steps = 1
    backend = finetune.strategy(cfg)
    config, tokenizer = pretrained_config(options.init_checkpoint)
    task = SquadTask(cfg.train, options, config, tokenizer)
    trainer = Trainer(cfg, strategy=backend, task=task)
    scores = trainer.evaluate()  # compiles the validation step
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        trainer.evaluate()
        seconds.append(time.perf_counter() - start)
    if backend.is_chief:
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "f1": scores.get("f1")}, f)
    backend.shutdown()


def side(root, args, ranks):
    """Seconds of each timed evaluation with `ranks` processes (1: no launcher)."""
    out = os.path.join(root, f"ranks{ranks}.json")
    command = [sys.executable, os.path.abspath(__file__), "--worker", root, out,
               *[f"--{k}={v}" for k, v in vars(args).items() if k not in ("worker", "strategy")]]
    if ranks > 1:
        command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np",
                   str(ranks), "-H", f"localhost:{ranks}", "--gloo", *command,
                   "--strategy=horovod"]
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, **ONE_THREAD})
    with open(out) as f:
        return json.load(f)


def main():
    args = parse_args()
    if args.worker:
        return worker(*args.worker, args, args.strategy)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tfbig-squad-predict-") as root:
        write_files(root, args)
        one, two = side(root, args, 1), side(root, args, 2)
    best = {1: min(one["seconds"]), 2: min(two["seconds"])}
    ratio = best[2] / best[1]
    print(f"SQuAD prediction of {args.questions} questions: 1 rank {best[1]:.2f} s, 2 ranks "
          f"{best[2]:.2f} s; ratio {ratio:.3f}", file=sys.stderr)
    assert one["f1"] == two["f1"], (one["f1"], two["f1"])  # the same predictions either way
    _record.emit({"benchmark": "squad_predict", "ratio": round(ratio, 4),
                  "seconds": {"1": round(best[1], 3), "2": round(best[2], 3)},
                  "all_seconds": {"1": [round(s, 3) for s in one["seconds"]],
                                  "2": [round(s, 3) for s in two["seconds"]]},
                  "f1": one["f1"], **{k: v for k, v in vars(args).items()
                                       if k not in ("worker", "strategy")},
                  "threads_per_rank": 1, "load_average_before": round(load_before, 2),
                  "load_average": round(os.getloadavg()[0], 2)})


if __name__ == "__main__":
    main()
