"""The embedded ALBERT run of the README, as it is typed: prep -> pretrain -> QA set -> fine-tune
from the pretrained checkpoint and from random init -> official scores. About 20 CPU-minutes."""
import json
import math
import os
import subprocess
import sys

import pytest


def run(*args, cwd):
    subprocess.run([sys.executable, "-m", *args], check=True, cwd=cwd,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


@pytest.mark.slow
def test_embedded_albert_squad_run(tmp_path):
    cwd = str(tmp_path)
    run("data_prep.prep", "--format=albert", "--seq_length=128", "--dupe_factor=3",
        "--output_dir=runs/albert-data", cwd=cwd)
    run("tfbig.train", "--model=albert", "--preset=small", "--data_dir=runs/albert-data",
        "--model_dir=runs/albert", "--max_steps=1000", "--batch_size=64", "--learning_rate=1e-2",
        "--warmup_steps=100", "--weight_decay=0.01", "--beta_2=0.999", "--epsilon=1e-6",
        "--eval_steps=10", "--log_every=100", cwd=cwd)
    run("data_prep.shakespeare_qa", "--output_dir=runs/qa", cwd=cwd)
    scores = {}
    for name, extra in (("pretrained", []), ("random", ["--random_init"])):
        run("tfbig.commands.squad", "--init_checkpoint=runs/albert", *extra,
            "--train_file=runs/qa/shakespeare-qa-v2.0-train.json",
            "--predict_file=runs/qa/shakespeare-qa-v2.0-dev.json", f"--output_dir=runs/{name}",
            "--max_seq_length=128", "--doc_stride=64", "--max_query_length=32",
            "--max_steps=1500", "--learning_rate=1e-3", cwd=cwd)
        with open(tmp_path / "runs" / name / "eval_results.json") as file:
            scores[name] = json.load(file)
    with open(tmp_path / "runs" / "albert" / "config.json") as file:
        assert json.load(file)["train"]["optimizer"] == "lamb"  # ALBERT's default
    print({name: {k: round(v, 2) for k, v in s.items()} for name, s in scores.items()})
    for s in scores.values():
        assert s["total"] > 1000 and all(math.isfinite(s[k]) for k in ("exact", "f1", "best_f1"))
        assert s["f1"] >= 100 * s["NoAns_total"] / s["total"] - 1e-6  # at least "always null"
