"""tfbig.plan without TensorFlow: the published 175B figure, named errors, the search, the CLI."""
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from tfbig.config import ExperimentConfig
from tfbig.commands import plan as cli
from tfbig.plan import estimate, hardware, search, speed
from tfbig.models import shapes as models
from tfbig.training.local_plan import training_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
P4D = ["--preset=175b", "--gpu=A100-40GB", "--gpus_per_node=8", "--nodes=120",
       "--seq_length=2048", "--internode_gbps=400"]


def plan(argv):
    """(flag values, fixed layout, estimates best first) of tfbig-plan flags."""
    flag_values = cli.flags.FlagValues()
    cli.define_flags(flag_values)
    flag_values(["tfbig-plan"] + argv)
    values = {name: flag_values[name].value for name in cli.FLAGS_SPEC}
    fixed = {n: values[n] for n in search.LAYOUT_FLAGS if flag_values[n].present}
    return values, fixed, cli.plan(values, fixed)[1]


def test_published_175b_on_120_p4d_within_20_percent():
    # The SageMaker 175B post: 32 samples/s at seq 2048 on 120 p4d.24xlarge with tensor,
    # pipeline and optimizer-state sharding plus activation checkpointing. Layout assumed:
    # T=8 (one node's NVLink), K=8 (the fewest stages whose state fits 40 GB with T=8),
    # D=15, ZeRO-1 over the 15 replicas, 1F1B, batch of ~1M tokens (the plan's default).
    _, _, estimates = plan(P4D + ["--tensor_parallel=8", "--pipeline_stages=8",
                                  "--zero_stage=1", "--activation_checkpointing",
                                  "--sequence_parallel=false"])
    best = estimates[0]
    assert (best.layout.data, best.layout.partition, best.batch_size) == (15, 15, 525)
    assert best.fits and best.memory_bytes < 40e9
    assert 0.8 * 32 <= best.samples_per_sec <= 1.2 * 32, best.samples_per_sec
    four_stages = plan(P4D + ["--tensor_parallel=8", "--pipeline_stages=4", "--zero_stage=1",
                              "--activation_checkpointing"])[2]
    assert not any(e.fits for e in four_stages)  # why K=8: K=4 cannot hold the state


def test_cli_answers_175b_in_under_2_seconds_without_tensorflow():
    env = {**os.environ, "PYTHONPATH": ROOT}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tfbig.plan"] + P4D, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert time.perf_counter() - start < 2.0
    for text in ("recommended: ", "memory per GPU", "samples/s", "tokens/s",
                 "model TFLOP/s per GPU", "MFU", "days", "GPU-hours"):
        assert text in out
    probe = "import sys, tfbig.commands.plan, tfbig.training.local_plan; print('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("argv, message", [
    (["--gpu=B200"], "--gpu='B200' is not in the GPU table; choose one of ['V100-16GB', "
     "'V100-32GB', 'A100-40GB', 'A100-80GB', 'H100-80GB', 'H200-141GB'], or describe the "
     "device with --peak_tflops and --hbm_gb"),
    (["--preset=13b", "--tensor_parallel=3"], "--tensor_parallel=3 does not divide the "
     "model's num_heads=40; choose one of [1, 2, 4, 5, 8, 10, 20, 40]"),
    (["--preset=1.3b", "--pipeline_stages=5"], "--pipeline_stages=5 does not divide the "
     "model's num_layers=24; choose one of [1, 2, 3, 4, 6, 8, 12, 24]"),
    (["--preset=1.3b", "--nodes=2", "--tensor_parallel=2", "--pipeline_stages=2",
      "--num_microbatches=3", "--batch_size=64"], "--batch_size=64 is not divisible into 4 "
     "data-parallel replicas x --num_microbatches=3 = 12 equal micro-batches; use a multiple "
     "of 12"),
    (["--preset=1.3b", "--precision=mixed_bfloat16", "--gpu=V100-32GB"],
     "--precision=mixed_bfloat16 has no hardware support on V100-32GB (it has ['fp16', "
     "'fp32']); choose another --precision or --gpu"),
    (["--preset=1.3b", "--nodes=2", "--tensor_parallel=2", "--pipeline_stages=2",
      "--zero_stage=1", "--shard_degree=3"], "--shard_degree=3 does not divide the 4 "
     "data-parallel replicas (16 GPUs / (--tensor_parallel=2 x --pipeline_stages=2)); choose "
     "one of [1, 2, 4]"),
])
def test_bad_input_is_a_named_error(argv, message, capsys):
    with pytest.raises(ValueError) as error:
        plan(argv)
    assert str(error.value) == message
    assert cli.main(["tfbig-plan"] + argv) == 2
    assert capsys.readouterr().err == f"tfbig-plan: {message}\n"


def test_given_flags_fix_the_layout_and_the_rest_is_searched():
    _, _, free = plan(["--preset=1.3b", "--nodes=2", "--batch_size=512"])
    assert {e.layout.tensor for e in free} == {1, 2, 4, 8}
    assert {e.layout.zero_stage for e in free} == {0, 1, 2, 3}
    assert {e.layout.activation_checkpointing for e in free} == {False, True}
    _, _, fixed = plan(["--preset=1.3b", "--nodes=2", "--batch_size=512", "--tensor_parallel=4",
                        "--zero_stage=2", "--shard_degree=2"])
    assert {(e.layout.tensor, e.layout.zero_stage, e.layout.partition) for e in fixed} == {
        (4, 2, 2)}
    assert all(e.layout.gpus == 16 for e in fixed)
    assert [e.samples_per_sec for e in fixed if e.fits] == sorted(
        (e.samples_per_sec for e in fixed if e.fits), reverse=True)


def test_13b_on_16_a100_40gb_needs_sharding():
    # The question: will a 13B model fit on 16 A100-40GB, and with which layout?
    _, _, plain = plan(["--preset=13b", "--nodes=2", "--tensor_parallel=1",
                        "--pipeline_stages=1", "--zero_stage=0"])
    assert not any(e.fits for e in plain)  # 16 bytes x 12.9B weights = 206 GB per GPU
    _, _, zero3 = plan(["--preset=13b", "--nodes=2", "--tensor_parallel=1",
                        "--pipeline_stages=1", "--zero_stage=3"])
    state, group = zero3[0].memory, zero3[0].layout.partition
    assert zero3[0].fits and group in (8, 16)  # a node (MiCS) or all 16 ranks
    params = 12.85e9
    # moments (8) per parameter over the group (tfbig's ZeRO-3 parameter slice is the float32
    # master copy, counted under parameters)
    assert state["optimizer"] == pytest.approx(8 * params / group, rel=0.01)
    assert state["parameters"] == pytest.approx(4 * params / group, rel=0.01)


def test_memory_terms_follow_zero_stage_and_schedule():
    shape = cli.shape_from_flags({**{k: v[1] for k, v in cli.FLAGS_SPEC.items()},
                                  "preset": "1.3b"})
    device = hardware.gpu("A100-80GB", "mixed_bfloat16")
    by_stage = {z: estimate.memory(shape, estimate.Layout(data=8, zero_stage=z), 1,
                                   "mixed_bfloat16", device) for z in range(4)}
    full = by_stage[0]
    # 8 bytes of moments per parameter unsharded; sharded over 8, plus the master slice (4)
    assert by_stage[1]["optimizer"] == pytest.approx(full["optimizer"] * (12 / 8) / 8)
    assert by_stage[1]["gradients"] == full["gradients"]
    assert by_stage[2]["gradients"] == full["gradients"] / 8
    assert by_stage[3]["parameters"] == full["parameters"] / 8
    gpipe, one_f = (estimate.memory(shape, estimate.Layout(pipeline=4, num_microbatches=16,
                                                           schedule=s), 1, "fp32", device)
                    for s in ("gpipe", "1f1b"))
    # GPipe holds all 16 micro-batches, 1F1B 4; both the backward's working set of one
    working = estimate.backward_working_bytes(shape, estimate.Layout(pipeline=4), "fp32") * (
        shape.seq_length)
    layer_part = (gpipe["activations"] - working) / 16
    assert one_f["activations"] == pytest.approx(4 * layer_part + working)


def test_v100_defaults_to_float16(capsys):
    assert cli.main(["tfbig-plan", "--preset=1.3b", "--gpu=V100-32GB", "--top=1"]) == 0
    out = capsys.readouterr().out
    assert "mixed_float16" in out and "125 TFLOP/s peak" in out


def test_json_holds_the_recommendation_and_the_table(capsys):
    assert cli.main(["tfbig-plan", "--preset=6.7b", "--nodes=4", "--top=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] == out["top"][0] and out["recommended"]["fits"]
    assert len(out["top"]) == 3 and out["cluster"]["size"] == 32
    for key in ("memory", "time", "samples_per_sec", "tokens_per_sec", "tflops_per_gpu",
                "mfu", "days", "gpu_hours"):
        assert key in out["recommended"]


def test_train_plan_only_reads_the_training_layout():
    cfg = ExperimentConfig()
    cfg.train.strategy, cfg.train.preset, cfg.train.batch_size = "pipeline", "tiny", 16
    cfg.pipeline.pipeline_stages, cfg.pipeline.num_microbatches = 2, 4
    assert search.layout_from_config(cfg) == {
        "tensor_parallel": 1, "context_parallel": 1, "expert_parallel": 1,
        "sequence_parallel": False,
        "zero_stage": 0, "shard_degree": 0, "pipeline_stages": 2, "num_microbatches": 4,
        "schedule": "1f1b", "activation_checkpointing": False}
    device = hardware.Device("cpu", 1e11, 16e9, 2e10, 2e10, 1.0, 0.0)
    text = training_plan(cfg, device=device, world_size=1)
    assert "recommended: D1 P2 T1 M4 1f1b" in text
    assert "batch 16 = 1 replicas x 4 micro-batches x 4 sequences" in text


def test_tfbig_train_plan_only_exits_before_any_data(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-m", "tfbig.train", "--plan_only", "--preset=tiny", "--batch_size=8",
         f"--data_dir={tmp_path}/none", f"--model_dir={tmp_path}/run", "--peak_tflops=0.1"],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "recommended: D1 P1 T1 M1" in out.stdout
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow  # a launch; --plan_only in one process: test_tfbig_train_plan_only_exits_before_any_data
def test_plan_only_under_horovodrun_prints_one_plan_of_the_whole_job(tmp_path):
    """Every rank plans (and checks) the layout; rank 0 alone prints it."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m",
         "tfbig.train", "--plan_only", "--preset=tiny", "--batch_size=8", "--strategy=horovod",
         f"--data_dir={tmp_path}/none", f"--model_dir={tmp_path}/run", "--peak_tflops=0.1"],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("recommended: ") == 1, out.stdout
    assert "recommended: D2 P1 T1 M1" in out.stdout
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("variables, first", [
    ({}, True),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, False),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                               "task": {"type": "worker", "index": 1}})}, False),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                               "task": {"type": "worker", "index": 0}})}, True),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                               "task": {"type": "worker", "index": 0}})}, False),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                               "task": {"type": "chief", "index": 0}})}, True),
], ids=["alone", "horovod-0", "mpi-1", "worker-1", "worker-0", "worker-0-of-chief", "chief"])
def test_the_first_process_of_a_job_is_the_one_that_prints(monkeypatch, variables, first):
    """And the job is planned for all its processes: a TF_CONFIG chief counts beside the
    workers."""
    from tfbig.distribute.mesh import RANK_VARIABLES, WORLD_SIZE_VARIABLES
    from tfbig.training.local_plan import first_process, processes

    for name in RANK_VARIABLES + WORLD_SIZE_VARIABLES + ("TF_CONFIG",):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert first_process() is first
    assert processes() == (1 if not variables else 2)


def test_albert_shared_layers_are_held_by_every_stage():
    shape = cli.shape_from_flags({**{k: v[1] for k, v in cli.FLAGS_SPEC.items()},
                                  "model": "albert", "preset": "xxlarge"})
    assert shape.params == 223_158_450 and shape.block_params == shape.layer_params
    first, last = (estimate.stage_params(shape, estimate.Layout(pipeline=4), last=x)
                   for x in (False, True))
    # every stage holds the one shared block; the first the embeddings, the last the pooler,
    # the heads and its copy of the tied word table (stages on different ranks)
    assert first == shape.block_params + (30000 + 512 + 2) * 128 + 2 * 128 + 128 * 4096 + 4096
    assert last == shape.params - first + shape.block_params + 30000 * 128
    gpt = cli.shape_from_flags({**{k: v[1] for k, v in cli.FLAGS_SPEC.items()},
                                "preset": "1.3b"})
    # GPT's last stage: its blocks of tfbig-train's FLOPs partition (5 of 24: the output
    # matrix costs 1.75 blocks), the final norm and the tied table's copy
    assert estimate.stage_params(gpt, estimate.Layout(pipeline=4), last=True) == (
        gpt.block_params * 5 / 24 + 2 * 2048 + 50257 * 2048)


def test_pipeline_activations_follow_the_schedule_per_stage():
    """Stage k of K holds all M micro-batches under GPipe, min(K - k, M) under 1F1B; its
    layers are those of the partition it is given; with checkpointing a pipeline stage keeps
    its input per micro-batch in flight and recomputes all its layers for one (whose input
    is its first layer's, not counted twice)."""
    shape = cli.shape_from_flags({**{k: v[1] for k, v in cli.FLAGS_SPEC.items()},
                                  "preset": "1.3b"})
    device = hardware.gpu("A100-80GB", "mixed_bfloat16")
    tokens, precision = shape.seq_length, "mixed_bfloat16"
    per_layer = estimate.layer_activation_bytes(shape, estimate.Layout(), precision) * tokens
    working = estimate.backward_working_bytes(shape, estimate.Layout(), precision) * tokens
    layers = estimate.partition_layers(shape, 4)  # the output matrix costs 1.75 blocks
    assert layers == (6, 6, 7, 5)
    for schedule in ("gpipe", "1f1b"):
        layout = estimate.Layout(pipeline=4, num_microbatches=8, schedule=schedule)
        for k in range(3):  # the last stage also keeps the loss's vocabulary-sized tensors
            live = 8 if schedule == "gpipe" else 4 - k
            assert estimate.activation_memory(shape, layout, 1, precision, k) == pytest.approx(
                live * layers[k] * per_layer + working)
        # the last stage differentiates its head first: the logits' gradient beside two
        # float32 copies of the output matrix's gradient, or then the layers' working set
        live = 8 if schedule == "gpipe" else 1
        head = estimate.head_bytes(shape, layout, precision) * tokens
        gradient = estimate.head_gradient_bytes(shape, layout)
        assert gradient == 2 * 4 * shape.last_params
        assert estimate.activation_memory(shape, layout, 1, precision, 3) == pytest.approx(
            live * layers[3] * per_layer + (live - 1) * head + max(head + gradient, working))
    uneven = estimate.Layout(pipeline=2, num_microbatches=4, stage_layers=(16, 8))
    assert estimate.activation_memory(shape, uneven, 1, precision, 0) == pytest.approx(
        2 * 16 * per_layer + working)
    assert estimate.stage_params(shape, uneven, stage=0) == pytest.approx(
        16 * shape.layer_params + shape.first_params)
    ckpt = estimate.Layout(pipeline=4, num_microbatches=8, activation_checkpointing=True)
    kept = estimate.stage_input_bytes(shape, ckpt, precision, 1) * tokens
    assert kept == 2 * shape.hidden_size * tokens
    assert estimate.activation_memory(shape, ckpt, 1, precision, 1) == pytest.approx(
        (3 - 1) * kept + 6 * per_layer + working)
    stage, worst = estimate.peak_stage_memory(shape, estimate.Layout(
        pipeline=4, num_microbatches=8, schedule="gpipe"), 1, precision, device)
    assert stage == 3  # GPipe: every stage holds all 8; the last also the logits' tensors
    assert worst == estimate.memory(shape, estimate.Layout(
        pipeline=4, num_microbatches=8, schedule="gpipe"), 1, precision, device, stage=3)


def test_search_cuts_stages_as_tfbig_train_does():
    """The plan's stages hold the layers of tfbig-train's FLOPs-balanced partition (one
    function: tfbig.layouts.partition over tfbig.models.shapes.layer_specs), and the slowest
    stage paces the pipeline."""
    from tfbig.layouts.partition import partition

    values = {**{k: v[1] for k, v in cli.FLAGS_SPEC.items()}, "preset": "1.3b"}
    shape = cli.shape_from_flags(values)
    cfg = models.model_config("gpt", "1.3b")
    for k in (2, 4, 8):
        trained = estimate.stage_layer_counts(partition(models.layer_specs(cfg, 2048), k))
        assert estimate.partition_layers(shape, k) == trained
    cluster = hardware.Cluster(hardware.gpu("A100-80GB", "mixed_bfloat16"), 8, 1, 50e9)
    best = search.search(shape, cluster, "mixed_bfloat16", 64,
                         fixed={"pipeline_stages": 4, "tensor_parallel": 1})[0]
    assert best.layout.stage_layers == (6, 6, 7, 5)
    # an even split would put 6 blocks and the output matrix on the last stage: slower
    even = dataclasses.replace(best.layout, stage_layers=(6, 6, 6, 6))
    balanced = speed.step_time(shape, best.layout, best.micro_batch, "mixed_bfloat16",
                                  cluster)
    uneven = speed.step_time(shape, even, best.micro_batch, "mixed_bfloat16", cluster)
    assert balanced["compute"] / uneven["compute"] == pytest.approx(7 / (6 + 618 / 352), 0.01)


def test_blockwise_attention_keeps_no_sequence_squared_term():
    # per token and layer: dense keeps the (T, T) softmax (2 a s bytes in 16 bits), blockwise
    # a float32 log-sum-exp per head (4 a bytes) whatever the length
    layout = estimate.Layout()
    per_token = {}
    for attention in ("dense", "blockwise"):
        for seq in (1024, 4096):
            cfg = models.model_config("gpt", "small", seq_length=seq, attention=attention)
            shape = models.shape_of(cfg, "gpt", seq)
            assert shape.blockwise == (attention == "blockwise")
            per_token[attention, seq] = estimate.layer_activation_bytes(shape, layout, "bf16")
    heads = models.model_config("gpt", "small").num_heads
    assert per_token["blockwise", 1024] == per_token["blockwise", 4096]
    for seq in (1024, 4096):
        assert per_token["dense", seq] - per_token["blockwise", seq] == 2 * heads * seq - 4 * heads
    # auto: dense below 1024 tokens, blockwise from there (tfbig.models.common.BLOCKWISE_FROM)
    assert [models.shape_of(models.model_config("gpt", "small"), "gpt", s).blockwise
            for s in (512, 1024)] == [False, True]
    values, _, _ = plan(["--preset=small", "--seq_length=4096", "--attention=dense",
                         "--gpus_per_node=1"])
    assert not cli.shape_from_flags(values).blockwise


def test_the_context_axis_divides_the_tokens_a_rank_holds():
    cfg = models.model_config("gpt", "small", seq_length=8192, attention="blockwise")
    shape = models.shape_of(cfg, "gpt", 8192)
    one, two = (estimate.activation_memory(shape, estimate.Layout(context=c), 1, "bf16")
                for c in (1, 2))
    # half the tokens per rank, each keeping the K and V of two tokens (the gathered whole)
    per_token = [estimate.layer_activation_bytes(shape, estimate.Layout(context=c), "bf16")
                 for c in (1, 2)]
    assert per_token[1] - per_token[0] == 2 * 2 * 2 * shape.hidden_size  # 16-bit K, V of 2
    assert 0.5 * one < two < 0.6 * one
    timed = speed.step_time(shape, estimate.Layout(context=2), 1, "bf16",
                               cli.cluster_from_flags(plan(["--gpus_per_node=2"])[0]))
    assert timed["context"] > 0 and timed["data"] > 0  # K/V exchanges; gradients over context
    _, _, free = plan(["--preset=small", "--seq_length=8192", "--gpus_per_node=2",
                       "--batch_size=2"])
    assert {e.layout.context for e in free} == {1, 2}
    assert all(e.layout.gpus == 2 for e in free)
    # with stages too (tfbig-train runs CP x PP: test_cross_rank's cp2_pp2), each boundary
    # carrying a rank's 1/C of the sequence
    _, _, four = plan(["--preset=small", "--seq_length=8192", "--gpus_per_node=4",
                       "--batch_size=4"])
    both = [e for e in four if e.layout.context == 2 and e.layout.pipeline == 2]
    assert both and all(e.to_dict()["refused"] is None for e in both)
    _, _, sharded = plan(["--preset=small", "--seq_length=8192", "--gpus_per_node=4",
                          "--context_parallel=2", "--zero_stage=3", "--batch_size=2"])
    assert {(e.layout.context, e.layout.data, e.layout.zero_stage) for e in sharded
            if e.layout.tensor == 1} == {(2, 2, 3)}  # CP x ZeRO-3: test_context_parallel's
    # cp2_dp2_zero3; and CP2 x TP2 with --sequence_parallel (its cp2_tp2_sequence)
    assert {(e.layout.tensor, e.layout.sequence_parallel) for e in sharded
            if e.layout.tensor > 1} == {(2, True)}
    _, _, fixed = plan(["--preset=small", "--seq_length=8192", "--gpus_per_node=2",
                        "--context_parallel=2", "--batch_size=2"])
    assert {(e.layout.context, e.layout.data) for e in fixed} == {(2, 1)}
    assert "C2" in fixed[0].layout.describe()
    with pytest.raises(ValueError, match="--context_parallel=3: the sequence length 8192"):
        plan(["--preset=small", "--seq_length=8192", "--context_parallel=3"])
