"""Pipeline stages on different Horovod ranks (--strategy=horovod --pipeline_stages=K) through
one real `horovodrun -np 4 --gloo` launch, against the single-device run on the same global
batch: first-batch gradients of every weight, losses over the steps, final weights, with
gradient accumulation and active clipping; GPipe and 1F1B; the checkpoint each stage rank writes
assembled into the single-device model; bad layouts refused without a launch. GPT by default,
with ZeRO-1 inside the stages (PP2 x DP2, stopped and resumed) and with each stage's sequences
split over 2 context ranks (CP2 x PP2); plain PP2 x DP2 (resumed), ALBERT (its shared block used
by both stages, its word table tied to the MLM head, the model inputs riding with the activation
to the last stage) and BERT (1F1B with recompute) in the slow launch; Llama (untied 1F1B, tied
GPipe) and an MoE Llama (stages alone, and with each stage's experts split over its data ranks:
--expert_parallel=2, with --zero_stage=1 too) in a slow launch of its own; the MoE Llama's
stages with their sequences split over 2 context ranks and their experts over 2 data ranks
(EP2 x CP2 x PP2) on 8 ranks.
"""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "distribute"))
from equality import RecordedGradients  # noqa: E402
from test_horovod import horovodrun, load, read, run_entry  # noqa: E402
from test_trainer import ReplicasTask, make_cfg  # noqa: E402

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.checkpoints.checkpoint import piece_dir, slot_owners  # noqa: E402
from tfbig.training.consolidate import consolidate  # noqa: E402
from tfbig.convert.run_dir import load_model  # noqa: E402
from tfbig.layouts import stage_checkpoint, zero_checkpoint  # noqa: E402
from tfbig.pipeline.cross_rank import pipeline_mesh, stage_plan  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

WORKER = os.path.join(HERE, "cross_rank_worker.py")
RANKS = 4
# Clipping at 0.5 is active at every step; accumulation 2 x 2 micro-batches per replica.
TRAIN = dict(max_steps=4, batch_size=8, grad_clip_norm=0.5, dropout=0.0, grad_accum_steps=2,
             hidden_size=16, num_heads=2, eval_steps=1)
SCENARIOS = {  # name: (stages, pipeline options, train options, worker options)
    # each stage's optimizer state sharded over its 2 data ranks (tfbig.pipeline.zero_stage)
    "pp2_dp2_zero1": (2, dict(schedule="1f1b", num_microbatches=2, zero_stage=1), {},
                      {"first_gradients": True, "interrupt_at": 1}),
    # each stage's sequences split over 2 context ranks: stage 0 sends its chunks of the
    # positions, every block attends over its context group (tfbig.distribute.context_parallel)
    "cp2_pp2": (2, dict(schedule="1f1b", num_microbatches=2, context_parallel=2), {},
                {"first_gradients": True}),
}
# A launch of its own (slow): the default run has GPT's stages across ranks (here and under
# TP x PP) and BERT's recomputed 1F1B stages in one process (test_pipeline_bert); BERT's and
# ALBERT's under TP x PP are slow too (test_tensor_pipeline's pp2_tp2_masked_lm launch).
SLOW_SCENARIOS = {
    # plain stages x data, stopped and resumed (the default launch: the same with ZeRO-1)
    "pp2_dp2_1f1b": (2, dict(schedule="1f1b", num_microbatches=2), {},
                     {"first_gradients": True, "interrupt_at": 1}),
    # four stages, GPipe, each stage's blocks recomputed (GPipe's schedule in the default run:
    # tests/pipeline/test_pipeline_equivalence.py, one process)
    "pp4_gpipe": (4, dict(schedule="gpipe", num_microbatches=4, activation_checkpointing=True),
                  {}, {"first_gradients": True}),
    # ALBERT: every sequence has 2 masked tokens, so per-micro-batch MLM means average to the
    # global batch's; LAMB, its recipe's optimizer.
    "albert_pp2_dp2_gpipe": (2, dict(schedule="gpipe", num_microbatches=2),
                             dict(model="albert", seq_length=32, optimizer="lamb",
                                  learning_rate=1e-2, weight_decay=0.01, epsilon=1e-6),
                             {"first_gradients": True}),
    # BERT: a block per layer, its word table tied to the MLM head on the last stage; 1F1B with
    # each stage's blocks recomputed in the backward
    "bert_pp2_dp2_1f1b_recompute": (2, dict(schedule="1f1b", num_microbatches=2,
                                            activation_checkpointing=True),
                                    dict(model="bert", seq_length=32, weight_decay=0.01,
                                         epsilon=1e-6),
                                    {"first_gradients": True}),
}
# A launch of its own (slow): Llama (RMSNorm, RoPE, SwiGLU, 4 query / 2 key-value heads), its
# untied head on the last stage, 1F1B; its tied word table read by both stages, GPipe; each
# stage's optimizer state sharded over its data ranks (ZeRO-1); and each stage's sequences
# split over 2 context ranks (RoPE at each rank's own positions on both stages).
MOE = dict(model="llama", preset="tiny-moe", num_layers=0, hidden_size=0, num_heads=0,
           grad_accum_steps=1)
LLAMA_SCENARIOS = {
    "llama_pp2_dp2_zero1": (2, dict(schedule="1f1b", num_microbatches=2, zero_stage=1),
                            dict(model="llama", num_heads=4), {"first_gradients": True}),
    "llama_cp2_pp2": (2, dict(schedule="1f1b", num_microbatches=2, context_parallel=2),
                      dict(model="llama", num_heads=4), {"first_gradients": True}),
    "llama_pp2_dp2_1f1b": (2, dict(schedule="1f1b", num_microbatches=2),
                           dict(model="llama", num_heads=4), {"first_gradients": True}),
    "llama_tied_pp2_dp2_gpipe": (2, dict(schedule="gpipe", num_microbatches=2),
                                 dict(model="llama", num_heads=4, preset="small"),
                                 {"first_gradients": True}),
    # an MoE Llama (4 experts, top-2): its routers' losses and token counts travel with the
    # hidden states; stages alone, and each stage's experts split over its 2 data ranks
    # (--expert_parallel=2, stopped and resumed from its (stage, expert rank) pieces). The
    # routers' losses are each micro-batch's: the reference accumulates micro-batches alike.
    "moe_pp2_dp2": (2, dict(schedule="1f1b", num_microbatches=2), MOE,
                    {"first_gradients": True, "micro_batch_reference": True}),
    "moe_ep2_pp2": (2, dict(schedule="1f1b", num_microbatches=2, expert_parallel=2), MOE,
                    {"first_gradients": True, "micro_batch_reference": True,
                     "interrupt_at": 1}),
    # and the other weights' optimizer state sharded over each stage's 2 data ranks (ZeRO-1;
    # tfbig.pipeline.expert_stage.ExpertZeroPipeline), stopped and resumed from its pieces
    "moe_ep2_pp2_zero1": (2, dict(schedule="1f1b", num_microbatches=2, expert_parallel=2,
                                  zero_stage=1), MOE,
                          {"first_gradients": True, "micro_batch_reference": True,
                           "interrupt_at": 1}),
}


def data_of(train, gpt_data, albert_data, bert_data=None):
    """The data fixture of a scenario's model."""
    return {"albert": albert_data, "bert": bert_data}.get(train.get("model"), gpt_data)


def pipeline_cfg(data_dir, model_dir, stages, pipeline, **train):
    cfg = make_cfg(data_dir, model_dir, strategy="horovod", **{**TRAIN, **train})
    cfg.pipeline.pipeline_stages = stages
    for key, value in pipeline.items():  # --zero_stage, --shard_degree: the parallel section
        section = cfg.pipeline if hasattr(cfg.pipeline, key) else cfg.parallel
        assert hasattr(section, key), key
        setattr(section, key, value)
    return cfg


def launch(scenarios, gpt_data, albert_data, bert_data, root, ranks=RANKS):
    """One `horovodrun -np RANKS` running every scenario; (root, directory of the results)."""
    out = root / "out"
    plan = [run_entry(name, pipeline_cfg(data_of(train, gpt_data, albert_data, bert_data),
                                         root / name, stages, pipeline, **train), out, **opts)
            for name, (stages, pipeline, train, opts) in scenarios.items()]
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt", timeout=900,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                      ranks=["-np", str(ranks), "-H", f"localhost:{ranks}"])
    assert code == 0, read(root / "log.txt")[-6000:]
    return root, out


@pytest.fixture(scope="module")
def runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(SCENARIOS, gpt_data, albert_data, bert_data,
                  tmp_path_factory.mktemp("cross_rank"))


@pytest.fixture(scope="module")
def slow_runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(SLOW_SCENARIOS, gpt_data, albert_data, bert_data,
                  tmp_path_factory.mktemp("cross_rank_slow"))


@pytest.fixture(scope="module")
def llama_runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(LLAMA_SCENARIOS, gpt_data, albert_data, bert_data,
                  tmp_path_factory.mktemp("cross_rank_llama"))


def reference(data_dir, model_dir, replicas, **train):
    """The single-device run on what the data-parallel replicas read together: its trainer
    (fitted; `recorded`: its gradients, tests/equality.py), per-step losses and
    {path: gradient} of the first batch."""
    cfg = make_cfg(data_dir, model_dir, **{**TRAIN, **train})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    trainer = Trainer(cfg, task=ReplicasTask(cfg.train, replicas, get_task(cfg.train, cfg)),
                      logger=logger)
    _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
    grads = {v.path: g.numpy() for v, g in zip(trainer.model.trainable_variables, grads)}
    trainer.recorded = RecordedGradients(trainer)
    trainer.summary = trainer.fit()
    return trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)]), grads


def held(result, prefix):
    return {str(p): result[f"{prefix}{i}"] for i, p in enumerate(result["paths"])}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SCENARIOS) + [
    pytest.param(name, marks=pytest.mark.slow) for name in [*SLOW_SCENARIOS, *LLAMA_SCENARIOS]])
def test_stage_ranks_equal_one_device_on_the_same_global_batch(gpt_data, albert_data,
                                                               bert_data, request, tmp_path,
                                                               name):
    fixture, scenarios = next((f, s) for f, s in (
        ("runs", SCENARIOS), ("slow_runs", SLOW_SCENARIOS), ("llama_runs", LLAMA_SCENARIOS))
        if name in s)
    _, out = request.getfixturevalue(fixture)
    scenario = scenarios[name]
    check_scenario(data_of(scenario[2], gpt_data, albert_data, bert_data), out, tmp_path, name,
                   scenario)


def check_scenario(data_dir, out, tmp_path, name, scenario, num_ranks=RANKS):
    """Every rank's losses, weights and first-batch gradients against one device."""
    stages, pipeline, train, opts = scenario
    data = num_ranks // (stages * pipeline.get("context_parallel", 1))  # data-parallel replicas
    ranks = [load(out, name, r) for r in range(num_ranks)]
    if opts.get("micro_batch_reference"):  # one micro-batch per replica's pipeline micro-batch
        # and as many validation batches of that size as the ranks' one batch holds
        train = {**train, "grad_accum_steps": data * pipeline["num_microbatches"]
                 * train.get("grad_accum_steps", TRAIN["grad_accum_steps"]),
                 "eval_steps": TRAIN["eval_steps"] * data * pipeline["num_microbatches"]}
    single, losses, grads = reference(data_dir, tmp_path, data, **train)
    expected = {v.path: v.numpy() for v in single.model.trainable_variables}
    covered = set()
    for result in ranks:
        assert int(result["step"]) == TRAIN["max_steps"]
        assert np.all(result["grad_norms"] > TRAIN["grad_clip_norm"])  # clipping is active
        # every rank logs the last stage's loss: the single-device losses
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
        single.recorded.assert_equal(held(result, "w"),
                                     err_msg=f"{name} rank stage {result['stage']}:")
        covered.update(held(result, "w"))
        for path, value in held(result, "g").items():  # copies of tied weights included
            np.testing.assert_allclose(value, grads[path], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name} gradient of {path}")
        # a stage rank holds its stage (and copies of tied weights), not the model
        assert int(result["held_bytes"]) < int(result["model_bytes"])
    assert covered == set(expected)  # every weight lives on some stage rank
    assert {(int(r["stage"]), int(r["data"])) for r in ranks} == {
        (s, d) for s in range(stages) for d in range(data)}
    # what stage 0 sends: (micro-batch, positions, hidden); with C context ranks its 2 chunks
    length = single.task.seq_length // pipeline.get("context_parallel", 1)
    assert all(int(r["sent_shape"][1]) == length for r in ranks), name
    if opts.get("interrupt_at"):
        assert int(ranks[0]["restored_step"]) == opts["interrupt_at"]
    eval_loss = single.summary["eval"]["loss"]
    assert float(ranks[0]["eval_loss"]) == pytest.approx(eval_loss, rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiproc
def test_experts_of_stages_split_over_context_ranks_equal_one_device(gpt_data, tmp_path_factory,
                                                                     tmp_path):
    """8 ranks = data 2 x pipeline 2 x context 2 with --expert_parallel=2: each stage's
    sequences split over a context group (its routers' losses summed over it), its experts over
    the expert groups of its data ranks; losses, weights and first gradients of one device."""
    name = "moe_ep2_cp2_pp2"
    scenario = (2, dict(schedule="1f1b", num_microbatches=2, expert_parallel=2,
                        context_parallel=2), MOE,
                {"first_gradients": True, "micro_batch_reference": True})
    _, out = launch({name: scenario}, gpt_data, None, None,
                    tmp_path_factory.mktemp("cross_rank_8"), ranks=8)
    check_scenario(gpt_data, out, tmp_path, name, scenario, num_ranks=8)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["moe_ep2_pp2", "moe_ep2_pp2_zero1"])
def test_expert_stage_pieces_read_back_as_one_model(llama_runs, name):
    """The (stage, expert rank) pieces joined (ZeRO-1: the pieces of data ranks 0..N-1 of
    each stage, which hold the experts): the weights its ranks ended with."""
    root, out = llama_runs
    model, _ = load_model(str(root / name))
    found = {}
    for rank in range(RANKS):
        found.update(held(load(out, name, rank), "w"))
    assert {v.path for v in model.trainable_variables} == set(found)
    for v in model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), found[v.path], err_msg=v.path)


@pytest.mark.multiproc
def test_stage_checkpoints_assemble_into_the_single_device_model(gpt_data, runs, tmp_path):
    root, out = runs  # CP2 x PP2: context rank 0 of each stage writes it
    model_dir = str(root / "cp2_pp2")
    layout = stage_checkpoint.read_layout(model_dir)
    assert layout["pipeline_stages"] == 2
    assert layout["stages"][0]["layers"][0] == "embedding"
    assert os.path.exists(os.path.join(model_dir, "pipeline", "stage-1", "checkpoint"))
    ranks = [load(out, "cp2_pp2", r) for r in range(RANKS)]
    trained = {}
    for result in ranks:
        trained.update(held(result, "w"))
    model, _ = load_model(model_dir)  # tfbig-generate / tfbig-export
    for v in model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), trained[v.path])
    written = consolidate(model_dir, str(tmp_path / "single"))
    cfg = make_cfg(gpt_data, tmp_path / "single", **TRAIN)
    resumed = Trainer(cfg)
    assert resumed.restored_from == written and int(resumed.step.numpy()) == TRAIN["max_steps"]
    for v in resumed.model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), trained[v.path])
    slots = slot_owners(resumed.optimizer)
    assert len(slots) == 2 * len(resumed.model.trainable_variables)
    assert all(np.any(s.numpy() != 0) for s in resumed.optimizer.variables if id(s) in slots)


@pytest.mark.multiproc
def test_zero1_stages_hold_half_the_slots_and_a_piece_each(gpt_data, runs, tmp_path):
    root, out = runs
    model_dir = str(root / "pp2_dp2_zero1")
    assert zero_checkpoint.read_layout(model_dir)["zero_stage"] == 1
    assert stage_checkpoint.read_layout(model_dir)["pipeline_stages"] == 2
    for stage in range(2):  # (stage, partition position) pieces: stage k, shard j
        for shard in range(2):
            directory = piece_dir(piece_dir(model_dir, "pipeline", stage), "zero", shard)
            assert tf.train.latest_checkpoint(directory), directory
    plain = {int(r["stage"]): int(r["slot_bytes"]) for r in  # whole slots (CP2 x PP2)
             (load(out, "cp2_pp2", r) for r in range(RANKS))}
    trained = {}
    for result in (load(out, "pp2_dp2_zero1", r) for r in range(RANKS)):
        # half of the stage's Adam slots, each variable's slice padded to a whole element
        padding = 2 * 4 * len(result["paths"])
        assert 0 <= 2 * int(result["slot_bytes"]) - plain[int(result["stage"])] <= 2 * padding
        trained.update(held(result, "w"))
    model, _ = load_model(model_dir)  # tfbig-generate / tfbig-export: the stages' weights
    for v in model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), trained[v.path])
    with pytest.raises(ValueError, match=r"written with --pipeline_stages and --zero_stage=1 "
                                         r"\(zero.json\): its optimizer slots are sliced"):
        consolidate(model_dir, str(tmp_path / "single"))
    assert not os.path.exists(tmp_path / "single")
    # a pipeline run without the sharding (or with another) does not resume it
    with pytest.raises(ValueError, match="was written with --zero_stage=1 over partition "
                                         "groups of 2 data rank"):
        stage_checkpoint.check_resume(model_dir, 2)
    stage_checkpoint.check_resume(model_dir, 2, zero=(1, 2))  # its own layout resumes


def cfg_with(**flags):
    cfg = config_lib.ExperimentConfig()
    cfg.train.strategy = "horovod"
    for key, value in flags.items():
        section = next(s for s in ("pipeline", "parallel", "horovod", "train")
                       if hasattr(getattr(cfg, s), key))
        setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.mark.parametrize("flags, world, message", [
    (dict(pipeline_stages=3), 4, "--pipeline_stages=3 x --tensor_parallel=1 = 3 does not "
                                 "divide 4"),
    (dict(pipeline_stages=2, zero_stage=2), 4, "--pipeline_stages=2 with --zero_stage=2 is "
                                               "not supported: each stage accumulates"),
    (dict(pipeline_stages=2, zero_stage=3), 4, "--pipeline_stages=2 with --zero_stage=3"),
    (dict(pipeline_stages=2, shard_degree=2), 4, "--shard_degree=2 needs --zero_stage=1"),
    (dict(pipeline_stages=2, zero_stage=1, shard_degree=3), 4, "--shard_degree=3 does not "
                                                               "divide the 2 data-parallel"),
    (dict(pipeline_stages=2, sequence_parallel=True), 2, "with --sequence_parallel=True"),
])
def test_unsupported_layouts_are_refused_before_training(flags, world, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        pipeline_mesh(cfg_with(**flags), world)


def test_schedule_flags_without_stages_are_refused_under_horovod():
    with pytest.raises(ValueError, match="--num_microbatches=8 has no effect with "
                                         "--strategy=horovod and --pipeline_stages=0"):
        config_lib.check_applicable(cfg_with(num_microbatches=8))
    config_lib.check_applicable(cfg_with(pipeline_stages=2, num_microbatches=8))  # accepted


def test_more_stages_than_layers_are_refused(gpt_data, tmp_path):
    cfg = pipeline_cfg(gpt_data, tmp_path, 5, {})  # embedding, 2 blocks, head: 4 layers
    with pytest.raises(ValueError, match="--pipeline_stages=5: the model has 4 layers"):
        stage_plan(get_task(cfg.train, cfg), cfg.pipeline, 5)


def test_the_stage_count_default_depends_on_the_strategy():
    assert config_lib.pipeline_stages(cfg_with()) == 1  # horovod: no pipeline
    pipeline = cfg_with()
    pipeline.train.strategy = "pipeline"
    assert config_lib.pipeline_stages(pipeline) == 2
