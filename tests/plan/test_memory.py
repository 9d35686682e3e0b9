"""Predicted bytes per rank beside the bytes measured on this machine (within 10%).

What is compared, per case (tfbig/training/measure.py): the model state a rank holds (weights
and optimizer slots: the bytes of its variables) and the peak of a training step (that state +
the CPU allocator's peak above it during forward, backward and apply). Cases: a single device,
which is also every rank of plain Horovod data parallelism (each holds the whole model state).
Under Horovod (2 ranks): plain data parallelism and ZeRO stages 1 and 2 (each rank holds the
whole parameters, half of the optimizer slots and a half-size float32 master copy) and 3 (half
of the slots and half of the parameters, which are its master copy); tensor parallelism over
both ranks; two pipeline stages on the two ranks (each its own stage's weights and slots).
The single-device step peaks are TensorFlow-graph steps (no XLA), which the plan counts.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from tfbig import config as config_lib

from tfbig.models.albert import ALBERT_PRESETS, AlbertConfig
from tfbig.models.gpt import GPT_PRESETS, GPTConfig
from tfbig.models import shapes as models

from tfbig.training.measure import measure_step

from .memory_probe import Case, predicted, predicted_rank_state

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")

MODEL_128 = dict(hidden_size=128, num_layers=2, num_heads=4, seq_length=128, vocab_size=2048)
MODEL_256 = dict(hidden_size=256, num_layers=4, num_heads=4, seq_length=256, vocab_size=8000)
# Below ~10 MB per step the allocator's rounding and XLA's fixed buffers dominate; these cases
# are the smallest where the closed form is the thing being measured.
MODEL_256_L8 = dict(MODEL_256, num_layers=8, vocab_size=1024)
# TensorFlow's graph (no XLA): what the plan counts. An XLA-compiled step assigns its own
# buffers; benchmarks/plan_accuracy.py reports its ratio beside these.
# Without XLA the step's peak depends on the order TensorFlow's threads run independent ops in,
# and so on the machine's load: h256 measured 1.14-1.15x the plan on a busy machine and with
# one inter-op thread (600.8 MB of tensors alive at the peak against 537.7 planned), 0.9-1.1x
# idle. A default test must not fail because the machine is busy, so h256 runs in the slow set
# until the plan counts that order; h128 (0.99-1.03x under load and with one thread) stays.
CASES = [Case("h128 no-xla", MODEL_128, 8, xla=False),
         pytest.param(Case("h256 no-xla", MODEL_256, 16, xla=False), marks=pytest.mark.slow),
         pytest.param(Case("h256 L8 v1024 no-xla", MODEL_256_L8, 16, xla=False),
                      marks=pytest.mark.slow)]  # 13 s


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_predicted_memory_within_10_percent_of_measured(case):
    plan, held = predicted(case), measure_step(case.model, case.micro_batch, case.xla)
    assert held["model_state"] == pytest.approx(plan["model_state"], rel=0.10)
    peak_plan = plan["model_state"] + plan["step_peak"]
    peak_held = held["model_state"] + held["step_peak"]
    assert peak_held == pytest.approx(peak_plan, rel=0.10), (plan, held)


def test_gpu_peaks_are_the_ones_mfu_is_reported_against():
    from tfbig.profiling import perf
    from tfbig.plan import hardware

    for name, (peaks, *_) in hardware.GPUS.items():
        reported = perf.GPU_PEAK_FLOPS[name.split("-")[0]]
        for precision, key in hardware.PRECISION_KEYS.items():
            if key in peaks:
                assert peaks[key] * 1e12 == reported[key], (name, precision)


def test_planner_configs_are_the_trainers():
    """The planner counts with the config classes the trainer's models are built from."""
    for family, presets, cls in (("gpt", GPT_PRESETS, GPTConfig),
                                 ("albert", ALBERT_PRESETS, AlbertConfig)):
        assert models.load_configs(family) == (cls, presets)
        for name in presets:
            assert models.model_config(family, name) == cls.from_preset(name)


def horovod_cases(data_dir, root, names=("dp2", "zero1", "zero2", "zero3", "tp2", "pp2")):
    """Per-rank cases `names` for one launch of 2 ranks; ZeRO / tensor-parallel rows are
    entries with cfg.parallel set (their layout is read back with layout_from_config)."""
    cfg = config_lib.ExperimentConfig()
    for key, value in dict(data_dir=data_dir, model_dir=str(root / "dp2"), preset="tiny",
                           seq_length=16, num_layers=2, hidden_size=64, num_heads=4,
                           batch_size=8, max_steps=1, warmup_steps=1, eval_steps=1,
                           checkpoint_every=1000, sample_tokens=0, xla=False,
                           strategy="horovod").items():
        setattr(cfg.train, key, value)
    cases = [{"name": "dp2", "config": config_lib.to_dict(cfg)}]
    for stage in (1, 2, 3):  # ZeRO over both ranks: slots and master copies in halves (3:
        # the parameters too, their slices being the master copies)
        cfg.train.model_dir = str(root / f"zero{stage}")
        cfg.parallel.zero_stage = stage
        cases.append({"name": f"zero{stage}", "config": config_lib.to_dict(cfg)})
    # Tensor-parallel over both ranks: each holds half of every split layer (and the
    # replicated LayerNorms and position table whole, which the plan's P / T leaves out).
    cfg.train.model_dir, cfg.parallel.zero_stage = str(root / "tp2"), 0
    cfg.parallel.tensor_parallel = 2
    cases.append({"name": "tp2", "config": config_lib.to_dict(cfg)})
    # Pipeline stages on the two ranks: each holds its stage's blocks (and the first the
    # embedding, the last the final norm and its copy of the tied token table).
    cfg.train.model_dir, cfg.parallel.tensor_parallel = str(root / "pp2"), 1
    cfg.pipeline.pipeline_stages, cfg.pipeline.num_microbatches = 2, 2
    cases.append({"name": "pp2", "config": config_lib.to_dict(cfg)})
    return [case for case in cases if case["name"] in names]


def launch(worker, cases, tmp_path, ranks=2):
    """`horovodrun -np ranks --gloo python worker cases.json tmp_path`; fails with its log."""
    with open(tmp_path / "cases.json", "w") as f:
        json.dump(cases, f)
    command = [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               sys.executable, os.path.join(HERE, worker), str(tmp_path / "cases.json"),
               str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=480)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (tmp_path / "log.txt").read_text()[-3000:]


@pytest.mark.multiproc
@pytest.mark.parametrize("names", [
    ("dp2", "zero3", "tp2", "pp2"),
    # 12 s: the default run checks stages 1 and 2's per-rank bytes against their closed form
    # in test_zero (test_per_rank_model_state_is_the_closed_form)
    pytest.param(("zero1", "zero2"), marks=pytest.mark.slow)], ids=["dp-zero3-tp-pp", "zero1-2"])
@pytest.mark.slow  # a 4-layout launch; bytes held per rank against the closed form stay by default in test_zero and test_tensor_parallel
def test_horovod_rank_model_state_within_10_percent(gpt_data, tmp_path, names):
    cases = horovod_cases(gpt_data, tmp_path, names)
    assert [case["name"] for case in cases] == list(names)
    launch("horovod_memory_worker.py", cases, tmp_path)
    for case in cases:
        for rank in (0, 1):
            with open(tmp_path / f"{case['name']}.rank{rank}.json") as f:
                record = json.load(f)
            assert record["world_size"] == 2
            assert record["model_state"] == pytest.approx(predicted_rank_state(record),
                                                          rel=0.10), (case["name"], rank)

