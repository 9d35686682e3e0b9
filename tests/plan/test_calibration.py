"""tfbig-plan and tfbig-train --plan_only with a calibration file (tfbig.plan.calibration): the
measured figures replace the spec table, each where the file says."""
import json

import pytest

from tfbig.config import ExperimentConfig, check_applicable
from tfbig.plan import calibration, estimate, hardware, speed
from tfbig.commands import plan as cli
from tfbig.models import shapes as models
from tfbig.training.local_plan import training_plan

# A single-process layout with two data ranks on one node: compute and the gradient all-reduce.
FIXED = ["--preset=tiny", "--gpus_per_node=2", "--tensor_parallel=1", "--pipeline_stages=1",
         "--zero_stage=0", "--num_microbatches=1", "--activation_checkpointing=false",
         "--batch_size=16", "--precision=fp32", "--json"]


def write(tmp_path, name="calibration.json", peak=1e11, allreduce_seconds=(1e-4, 1e-2),
          efficiency=None, **changes):
    data = {"schema": calibration.SCHEMA, "measured_by": "tfbig-doctor", "hosts": 1, "ranks": 2,
            "device": {"kind": "cpu", "name": "test cpu", "memory_bytes": 8e9, "threads": 1},
            "peak_flops": {"fp32": peak},
            "matmul_efficiency": {"fp32": efficiency or {"256": 1.0, "1024": 1.0}},
            "memory_bandwidth": 1e10,
            "collectives": {"intra_host": {kind: {"ranks": 2, "bytes": [4096, 2 ** 22],
                                                  "seconds": list(allreduce_seconds)}
                                           for kind in ("allreduce", "allgather",
                                                        "reducescatter")}}}
    data.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def planned(path, capsys, extra=()):
    assert cli.main(["tfbig-plan", *FIXED, f"--calibration={path}", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_takes_peak_and_collective_times_from_the_calibration(tmp_path, capsys):
    # a memory so fast that the matmuls' operand traffic is nothing: their time is the peak's
    fast_memory = {"memory_bandwidth": 1e15}
    base = planned(write(tmp_path, **fast_memory), capsys)
    assert base["top"][0]["layout"]["data"] == 2 and base["calibration"].endswith(".json")
    faster = planned(write(tmp_path, "fast.json", peak=2e11, **fast_memory), capsys)
    slower_network = planned(write(tmp_path, "slow.json", allreduce_seconds=(1e-4, 2e-2),
                                   **fast_memory), capsys)
    compute, data = base["top"][0]["time"]["compute"], base["top"][0]["time"]["data"]
    assert faster["top"][0]["time"]["compute"] == pytest.approx(compute / 2, rel=1e-4)
    assert faster["top"][0]["time"]["data"] == pytest.approx(data)
    # the tiny model's float32 gradients (~2.5 MB) sit between the two measured sizes: twice
    # the time at the top size doubles the interpolated share of it
    assert data < slower_network["top"][0]["time"]["data"] < 2 * data
    assert slower_network["top"][0]["time"]["compute"] == pytest.approx(compute)
    # the spec table's figures for the same layout, beside
    assert base["spec"]["layout"] == base["top"][0]["layout"]
    assert base["spec"]["step_seconds"] != pytest.approx(base["top"][0]["step_seconds"])


def test_small_matmuls_run_at_their_measured_efficiency(tmp_path):
    cfg = models.model_config("gpt", "tiny")
    shape = models.shape_of(cfg, "gpt", cfg.seq_length)
    loaded = calibration.load(write(tmp_path, efficiency={"64": 0.25, "4096": 1.0}))
    device = calibration.device(loaded, "fp32")
    fraction = speed.matmul_fraction(shape, estimate.Layout(), 8, device)
    assert 0.25 < fraction < 1.0
    # more tokens per matmul: larger products, nearer the large-size efficiency
    assert speed.matmul_fraction(shape, estimate.Layout(), 64, device) > fraction
    # without a calibration: a spec-table GPU's products below the big-GEMM fraction by their
    # memory traffic (tests/plan/test_published.py), a device without the table's at its own
    spec = hardware.gpu("A100-40GB")
    assert speed.matmul_fraction(shape, estimate.Layout(), 8, spec) < hardware.MATMUL_FRACTION
    assert speed.matmul_fraction(shape, estimate.Layout(), 8, hardware.custom_device(
        100, 40)) == hardware.MATMUL_FRACTION


def test_the_text_plan_prints_calibrated_and_spec_side_by_side(tmp_path, capsys):
    argv = [a for a in FIXED if a != "--json"] + [f"--calibration={write(tmp_path)}"]
    assert cli.main(["tfbig-plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "calibration: " in out and "test cpu (measured)" in out
    assert "calibrated vs spec: step" in out


@pytest.mark.parametrize("change, message", [
    ({"schema": "other"}, "schema 'other', expected 'tfbig-calibration/1'"),
    ({"peak_flops": {"bf16": 1e11}}, "has no fp32 matmul figure"),
    ({"device": {}}, "missing or malformed field"),
])
def test_a_bad_calibration_is_a_named_error(tmp_path, capsys, change, message):
    assert cli.main(["tfbig-plan", *FIXED, f"--calibration={write(tmp_path, **change)}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfbig-plan: --calibration=") and message in err, err
    assert cli.main(["tfbig-plan", *FIXED, f"--calibration={tmp_path}/none.json"]) == 2
    assert "no such file; write one with tfbig-doctor" in capsys.readouterr().err


def test_train_plan_only_uses_the_calibration(tmp_path):
    cfg = ExperimentConfig()
    cfg.train.preset, cfg.train.batch_size, cfg.train.precision = "tiny", 16, "fp32"
    cfg.train.plan_only, cfg.train.calibration = True, write(tmp_path)
    device = hardware.Device("cpu", 1e11, 16e9, 2e10, 2e10, 1.0, 0.0)
    text = training_plan(cfg, device=device, world_size=2)
    assert "test cpu (measured)" in text and "calibrated vs spec: step" in text


def test_calibration_without_plan_only_is_refused(tmp_path):
    cfg = ExperimentConfig()
    cfg.train.calibration = write(tmp_path)
    with pytest.raises(ValueError, match="--calibration=.* is read by --plan_only only"):
        check_applicable(cfg)


def test_a_narrow_models_logits_pay_their_traffic_and_square_products_their_measured_time(
        tmp_path):
    """The calibrated matmul time is a roofline sum: a square product of a measured size takes
    its measured time (the efficiency's own operand traffic is taken out, then added back), and
    a narrow model's vocabulary-wide logits (2048 x 64 x 8000: 16 FLOPs per byte streamed)
    take their streamed bytes besides, where the cube-root size alone ran them near peak."""
    loaded = calibration.load(write(tmp_path, peak=1.4e11, memory_bandwidth=1e10,
                                    efficiency={"64": 0.4, "256": 0.8, "1024": 0.9}))
    device = calibration.device(loaded, "fp32")
    for size, fraction in ((256, 0.8), (1024, 0.9)):
        compute = dict(device.matmul_efficiency)[size]
        seconds = 2 * size ** 3 / (1.4e11 * compute) + 3 * size ** 2 * 4 / 1e10
        assert seconds == pytest.approx(2 * size ** 3 / (1.4e11 * fraction))
    narrow = models.shape_of(models.model_config("gpt", "tiny", hidden_size=64, vocab_size=8000),
                             "gpt", 128)
    streamed = speed.matmul_fraction(narrow, estimate.Layout(), 16, device)
    # the same measured efficiencies on a memory 1000 times faster: the traffic is nothing
    instant = calibration.device(calibration.load(write(
        tmp_path, "instant.json", peak=1.4e11, memory_bandwidth=1e13,
        efficiency={"64": 0.4, "256": 0.8, "1024": 0.9})), "fp32")
    assert streamed < 0.8 * speed.matmul_fraction(narrow, estimate.Layout(), 16, instant)


def test_softmax_and_layernorm_passes_take_the_measured_softmax_rate(tmp_path):
    """A calibration's normalisation_bandwidth (tfbig-doctor's row-softmax probe) times the
    softmaxes' and LayerNorms' row passes and the loss's softmax; the other element-wise passes
    keep the map rate. Measured at the map rate, the plan is the one without the field."""
    cfg = models.model_config("gpt", "tiny")
    shape = models.shape_of(cfg, "gpt", cfg.seq_length)

    def elementwise(**fields):
        cluster = calibration.cluster(calibration.load(write(
            tmp_path, f"{len(fields)}{sorted(fields.values())}.json", **fields)), "fp32", 1, 1,
            0.0)
        return speed.step_time(shape, estimate.Layout(), 8, "fp32", cluster)["elementwise"]

    unmeasured = elementwise()
    assert elementwise(normalisation_bandwidth=1e10) == pytest.approx(unmeasured)
    slower = elementwise(normalisation_bandwidth=2.5e9)
    rows = (2 * estimate.normalisation_bytes(shape, estimate.Layout(), "fp32") * cfg.num_layers
            + estimate.LOSS_SOFTMAX_BYTES * cfg.vocab_size) * 8 * cfg.seq_length
    assert slower - unmeasured == pytest.approx(rows / 2.5e9 - rows / 1e10)
