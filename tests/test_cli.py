"""Console scripts as a user meets them: grouped --help, one-line errors with exit code 2 and no
traceback (nor TensorFlow's cuInit noise), while genuine bugs keep their traceback."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tfbig.commands import cli
from tfbig.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TINY = dict(preset="tiny", num_layers=2, hidden_size=16, num_heads=2, seq_length=16,
            batch_size=4, log_every=1, eval_steps=1, sample_tokens=0, xla=False,
            monitor_interval_ms=0)


def command(name, *args, timeout=300):
    """Run console script `name` from this tree (PYTHONPATH); (exit code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user's shell has it
    done = subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def train_flags(data_dir, model_dir, **extra):
    return [f"--{k}={v}" for k, v in {**TINY, "data_dir": data_dir, "model_dir": model_dir,
                                      **extra}.items()]


def test_the_last_line_of_a_run_says_steps_wall_time_and_bits_per_byte():
    from tfbig.commands.train import done_line

    summary = {"step": 500, "eval": {"loss": 4.95, "bits_per_byte": 2.23571}}
    assert done_line(summary, 601.4) == (
        "done: step 500, 10 min 1 s wall in this process, validation bits per byte 2.2357")
    assert done_line({"step": 3, "eval": {}}, 59.6) == "done: step 3, 1 min 0 s wall in this process"


def test_train_help_lists_its_own_flags_by_section():
    code, out, err = command("tfbig-train", "--help")
    assert code == 0 and err == ""
    assert out.startswith("usage: tfbig-train [--flag=value ...]\n")
    for section in ("train:", "pipeline:", "profile:", "albert:", "multiworker:", "horovod:",
                    "parallel:"):
        assert f"\n{section}\n" in out, section
    assert ("  --max_steps=int\n      Optimizer steps to train for, in total across resumes (0: "
            "as many as fit in\n      --time_budget_minutes). (default: 0)\n") in out
    assert "  --xla  (or --noxla)\n" in out
    assert "Try --helpfull" not in out and "--logtostderr" not in out  # absl's own flags
    assert out.index("\ntrain:\n") < out.index("  --max_steps=int") < out.index("\npipeline:\n")


def test_no_command_imports_tensorflow_before_it_runs():
    """Every console script's module (and so its --help and flag errors) loads without
    TensorFlow, whose import alone takes seconds; a run imports it when it starts."""
    sys.path.insert(0, os.path.join(ROOT, "docs", "hooks"))
    from generate import console_scripts

    modules = sorted({entry.split(":")[0] for _, entry in console_scripts()})
    assert len(modules) > 8
    probe = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('tensorflow', 'keras', 'horovod')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout[:2000]


@pytest.mark.parametrize("name,flag", [("tfbig-prep", "--vocab_size=int"),
                                       ("tfbig-generate", "--top_p=float"),
                                       ("tfbig-export", "--export_dir=string"),
                                       ("tfbig-squad", "--doc_stride=int")])
def test_every_absl_command_has_grouped_help(name, flag):
    code, out, err = command(name, "--help")
    assert code == 0 and out.startswith(f"usage: {name} [--flag=value ...]\n"), err[-2000:]
    assert f"\n  {flag}\n" in out and "Try --helpfull" not in out


@pytest.mark.parametrize("args,message", [
    (["--max_steps=abc"], "tfbig-train: error: flag --max_steps=abc: invalid literal for int() "
                          "with base 10: 'abc'; see tfbig-train --help"),
    (["--no_such_flag=1"], "tfbig-train: error: Unknown command line flag 'no_such_flag'; "
                           "see tfbig-train --help"),
    (["stray"], "tfbig-train: error: unexpected arguments ['stray']; every option is a --flag"),
    (["--data_dir=/no/such/dir", "--model_dir=/tmp/x"],
     "tfbig-train: error: /no/such/dir/manifest.json not found: /no/such/dir is not a prepared "
     "data directory (run tfbig-prep --output_dir=... first, or check the path)"),
])
def test_train_user_mistakes_are_one_line(args, message):
    code, out, err = command("tfbig-train", *args)
    assert (code, out, err) == (2, "", message + "\n")


def test_other_commands_user_mistakes_are_one_line(tmp_path):
    assert command("tfbig-generate", f"--model_dir={tmp_path}") == (
        2, "", f"tfbig-generate: error: --model_dir={tmp_path} has no config.json; train a "
               f"model there with tfbig-train first\n")
    assert command("tfbig-export", f"--model_dir={tmp_path}") == (
        2, "", "tfbig-export: error: flag --export_dir=None: Flag --export_dir must have a "
               "value other than None.; see tfbig-export --help\n")
    assert command("tfbig-launch", "--workers=0", "--", "true") == (
        2, "", "tfbig-launch: error: --workers=0: expected at least 1; see tfbig-launch "
               "--help\n")
    assert command("tfbig-profile", "report", str(tmp_path)) == (
        2, "", f"tfbig-profile: error: {tmp_path}/profile/run.json not found: {tmp_path} is "
               f"not a run directory of tfbig-train (or ran with an older tfbig)\n")


def _raise(error):
    raise error


def test_user_errors_are_tfbigs_own_checks_and_bugs_keep_their_traceback():
    import numpy as np

    def caught(fn, *args):
        try:
            fn(*args)
        except Exception as error:  # noqa: BLE001
            return cli.user_message(error)

    from tfbig.training.step import micro_batch_size

    assert caught(micro_batch_size, 6, 1, 4).startswith("--batch_size=6 must be")
    assert caught(_raise, UsageError("--x=1: bad")) == "--x=1: bad"
    assert caught(np.reshape, np.zeros(3), (2, 2)) is None  # a ValueError inside numpy
    assert caught(_raise, TypeError("--batch_size")) is None
    assert caught(_raise, KeyError("x")) is None


@pytest.fixture(scope="module")
def no_validation_data(tmp_path_factory):
    import random

    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("novalid")
    rng = random.Random(0)
    words = "love night light sweet death fair heaven star moon speak sword rose".split()
    os.makedirs(root / "text")
    for d in range(20):
        with open(root / "text" / f"doc{d}.txt", "w") as f:
            f.write("\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(12)))
    return prepare([str(root / "text")], str(root / "shards"), seq_length=16, vocab_size=300,
                   shard_size_mb=0.01, validation_fraction=0.0).data_dir


def test_run_without_validation_split_trains_and_a_damaged_resume_is_one_line(
        no_validation_data, tmp_path):
    model_dir = tmp_path / "run"
    flags = train_flags(no_validation_data, model_dir, max_steps=2)
    code, out, err = command("tfbig-train", *flags)
    assert code == 0, err[-3000:]
    assert out.startswith(f"no validation split in {no_validation_data}: training without "
                          f"evaluation (prepare the data with tfbig-prep "
                          f"--validation_fraction > 0 to evaluate)\n"), out
    assert "validation:" not in out and f"checkpoint: {model_dir}/ckpt-2" in out
    assert re.fullmatch(r"done: step 2, \d+ min \d+ s wall in this process", out.splitlines()[-1])
    assert "cuInit" not in err and "Traceback" not in err
    with open(model_dir / "ckpt-2.data-00000-of-00001", "r+b") as f:
        f.truncate(100)
    code, out, err = command("tfbig-train", *flags[:-1], "--max_steps=4")
    assert code == 2 and err.startswith(
        f"tfbig-train: error: --model_dir={model_dir}: no intact checkpoint to resume from: "
        f"{model_dir}/ckpt-2 ({model_dir}/ckpt-2.data-00000-of-00001: 100 bytes, ") and \
        err.endswith(" recorded (truncated)). Restore the files from a backup, or start "
                     "afresh with another --model_dir (nothing was changed)\n"), err
    assert err.count("\n") == 1


def test_corrupt_shard_is_one_line_naming_the_file_and_the_fix(gpt_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(gpt_data, data)
    with open(data / "manifest.json") as f:
        shards = [s["file"] for s in json.load(f)["splits"]["train"]["shards"]]
    for name in shards:  # every train shard loses its second half
        path = data / name
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    code, out, err = command("tfbig-train", *train_flags(str(data), tmp_path / "run",
                                                         max_steps=50, deterministic=True))
    assert code == 2, err[-3000:]
    # TensorFlow's own C++ log lines may precede it; the error itself is one line, last.
    last = err.splitlines()[-1]
    assert last.startswith(f"tfbig-train: error: shard {data}/"), err[-3000:]
    assert " is corrupt or truncated: read " in last and last.endswith(
        " records listed in manifest.json; prepare the data again or pass --skip_corrupt")
    assert "Traceback" not in err and "assertion failed" not in err and "[[{{node" not in err
    assert "cuInit" not in err
