"""tfbig-train --init_checkpoint into layouts that split the weights over ranks, through real
`horovodrun --gloo` launches, against one process started from the same checkpoint on the same
global batch: losses over 4 steps at rtol 1e-5, final weights by tests/equality.py's rule and
(but for the pipeline, whose stages hold parts) first-batch gradients.

The sources are tfbig-train --model_dir runs of a tiny Llama (hidden 32, 2 layers, 4 query / 2
key-value heads) and of a tiny MoE Llama (--preset=tiny-moe: 4 experts, top-2), trained one step
from another seed, so their weights are neither run's fresh initialisation. Each rank reads its
pieces through its backend's Strategy.weight_pieces (tfbig.convert.init_checkpoint): a tensor
rank its heads and columns, a ZeRO-3 rank its flat slice of every weight, a pipeline stage only
its own layers' weights, an expert rank its experts. Default run: TP2 (the default run's Llama
TP2: tests/distribute/test_tensor_parallel_llama.py's is slow), TP2 from the dense source's
Hugging Face export (sharded safetensors read in place, tfbig.convert.llama), ZeRO-3 over 2
ranks, PP2, CP2 (each rank half of every sequence, RoPE at its own positions), EP2 and EP2
from the MoE source's Hugging Face export (its experts one tensor each, an expert rank reading
its own), in one 2-rank launch. Slow: EP2 x TP2 (with ZeRO-1 too), TP2 x ZeRO-3, EP2 x DP2
with ZeRO-3 (an expert rank's experts whole, the other weights' slices over the 4 ranks) and
EP2 x PP2 (a stage's rank its stage's share of the experts) on 4 ranks, and TP2 x DP2 of the
dense source with Qwen 3's query/key norms added (one scale per norm, replicated, read by
every tensor rank for its own heads: its gradient summed over the tensor group), and TP2 x DP2
of it with one key/value head (multi-query attention: both tensor ranks hold the key/value
projections whole and sum their gradients), alone, under ZeRO-3 and inside 2 pipeline stages.
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from equality import RecordedGradients  # noqa: E402
from test_horovod import listed, load, read, run_entry, run_plan  # noqa: E402
from test_trainer import ReplicasTask, make_cfg  # noqa: E402
from horovod_worker import RecordingLogger  # noqa: E402
from tfbig.config import TrainConfig  # noqa: E402
from tfbig.convert import init_checkpoint, llama, run_dir  # noqa: E402
from tfbig.checkpoints.checkpoint import model_variables  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

TRAIN = dict(model="llama", max_steps=4, batch_size=8, grad_clip_norm=0.5, dropout=0.0,
             eval_steps=0)
SOURCES = {"dense": dict(model="llama"),
           "moe": dict(model="llama", preset="tiny-moe", num_layers=0, hidden_size=0,
                       num_heads=0)}
# the architecture is the checkpoint's: no preset, no sizes
FROM = dict(preset=TrainConfig.preset, num_layers=0, hidden_size=0, num_heads=0)
# name: (ranks, source, data replicas, parallel flags, pipeline flags)
SCENARIOS = {"tp2": (2, "dense", 1, {"tensor_parallel": 2}, {}),
             # the dense source exported to Hugging Face safetensors, read in place
             "tp2_hf": (2, "hf", 1, {"tensor_parallel": 2}, {}),
             "zero3": (2, "dense", 2, {"zero_stage": 3}, {}),
             "pp2": (2, "dense", 1, {}, {"pipeline_stages": 2, "num_microbatches": 2}),
             # each rank half of every sequence's positions (chunks i and 3 - i), RoPE at
             # its own positions, the key/value heads gathered over the context group
             "cp2": (2, "dense", 1, {"context_parallel": 2}, {}),
             "ep2": (2, "moe", 2, {"expert_parallel": 2}, {}),
             # the MoE source's Hugging Face export (Mixtral names: one tensor per expert),
             # read in place: each expert rank reads its own experts' tensors
             "ep2_hf": (2, "hf_moe", 2, {"expert_parallel": 2}, {})}
SLOW_SCENARIOS = {"ep2_tp2": (4, "moe", 2, {"expert_parallel": 2, "tensor_parallel": 2}, {}),
                  # ... with each tensor rank's non-expert optimizer state sliced over its
                  # data ranks (the master slices cut from the checkpoint's weights)
                  "ep2_tp2_zero1": (4, "moe", 2, {"expert_parallel": 2, "tensor_parallel": 2,
                                                  "zero_stage": 1}, {}),
                  "tp2_zero3": (4, "dense", 2, {"tensor_parallel": 2, "zero_stage": 3}, {}),
                  # Qwen 3's query/key norms: each tensor rank's heads read the one scale
                  "tp2_qk_norm": (4, "qk_norm", 2, {"tensor_parallel": 2}, {}),
                  # one key/value head, two tensor ranks: both hold it whole (replicated)
                  "tp2_replicated_kv": (4, "mqa", 2, {"tensor_parallel": 2}, {}),
                  # ... with ZeRO-3 (the whole projections' slices gathered per block) and
                  # inside pipeline stages of 2 tensor ranks
                  "tp2_replicated_kv_zero3": (4, "mqa", 2, {"tensor_parallel": 2,
                                                            "zero_stage": 3}, {}),
                  "tp2_pp2_replicated_kv": (4, "mqa", 1, {"tensor_parallel": 2},
                                            {"pipeline_stages": 2, "num_microbatches": 2}),
                  "ep2_zero3": (4, "moe", 4, {"expert_parallel": 2, "zero_stage": 3}, {}),
                  # 2 data replicas x 2 micro-batches, each with its own router losses: the
                  # reference's 4 micro-batches in the same order
                  "ep2_pp2": (4, "moe", 4, {"expert_parallel": 2},
                              {"pipeline_stages": 2, "num_microbatches": 2})}


@pytest.fixture(scope="module")
def sources(gpt_data, tmp_path_factory):
    """{kind: a tfbig-train --model_dir of one step from seed 5}."""
    root = tmp_path_factory.mktemp("init_sources")
    for kind, train in SOURCES.items():
        Trainer(make_cfg(gpt_data, root / kind, **{**train, "max_steps": 1, "seed": 5})).fit()
    llama.export(str(root / "dense"), str(root / "hf"), max_shard_bytes=20_000)
    llama.export(str(root / "moe"), str(root / "hf_moe"), max_shard_bytes=20_000)
    write_variant(root / "dense", root / "qk_norm", qk_norm=True)
    write_variant(root / "dense", root / "mqa", num_kv_heads=1)
    return {**{kind: str(root / kind) for kind in SOURCES}, "hf": str(root / "hf"),
            "hf_moe": str(root / "hf_moe"), "qk_norm": str(root / "qk_norm"),
            "mqa": str(root / "mqa")}


def write_variant(dense, out, **changes):
    """The dense source with its config's `changes` (Qwen 3's query/key norms; one key/value
    head): the source's weights where the shapes agree, the others drawn (norm scales around
    1, so their gradients matter)."""
    import dataclasses

    import keras

    from tfbig.models.llama import Llama

    config, _ = run_dir.read_config(str(dense), families=("llama",))
    config = dataclasses.replace(config, **changes)
    keras.utils.set_random_seed(9)
    model = Llama(config)
    model.build()
    source = run_dir.read_weights(str(dense))
    rng = np.random.default_rng(9)
    weights = {}
    for key, variable in model_variables(model).items():
        weights[key] = source.get(key)
        if weights[key] is None or weights[key].shape != tuple(variable.shape):
            weights[key] = (float(key.endswith("norm/scale")) + 0.2 * rng.standard_normal(
                variable.shape)).astype("float32")
    run_dir.write_run(str(out), config, weights, None,
                      {"tokenizer.model": os.path.join(dense, "tokenizer.model")}, "test", "llama")


def scenario_cfg(gpt_data, model_dir, source, parallel, pipeline, **train):
    cfg = make_cfg(gpt_data, model_dir, **{**TRAIN, **FROM, "init_checkpoint": source, **train})
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    for key, value in pipeline.items():
        setattr(cfg.pipeline, key, value)
    return cfg


def launch(root, scenarios, ranks, gpt_data, sources):
    plan = [run_entry(name, scenario_cfg(gpt_data, root / name, sources[source], parallel,
                                         pipeline, strategy="horovod"), root / "out",
                      first_gradients=not pipeline)
            for name, (_, source, _, parallel, pipeline) in scenarios.items()]
    os.makedirs(root / "out")
    run_plan(root, plan, ranks)
    return root


@pytest.fixture(scope="module")
def runs(gpt_data, sources, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("init_split"), SCENARIOS, 2, gpt_data, sources)


@pytest.fixture(scope="module")
def slow_runs(gpt_data, sources, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("init_split_4"), SLOW_SCENARIOS, 4, gpt_data, sources)


def reference(gpt_data, model_dir, source, replicas, moe):
    """One process from `source` reading every replica's batch (an MoE model's as one
    micro-batch each); (trainer, losses, first-batch gradients). Its first weights are the
    source's."""
    # an MoE model's router losses are each replica's micro-batch's (tfbig.tasks.llama)
    cfg = scenario_cfg(gpt_data, model_dir, source, {}, {},
                       grad_accum_steps=replicas if moe else 1)
    inner = get_task(*init_checkpoint.task_inputs(cfg.train, cfg))
    init_checkpoint.apply(inner, cfg)
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    trainer = Trainer(cfg, task=ReplicasTask(cfg.train, replicas, inner), logger=logger)
    saved = run_dir.read_weights(source)
    ours = {k: v.numpy() for k, v in model_variables(trainer.model).items()}
    assert sorted(ours) == sorted(saved)
    assert all(np.array_equal(ours[k], saved[k]) for k in saved)
    _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
    trainer.recorded = RecordedGradients(trainer)
    trainer.fit()
    return (trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)]),
            [g.numpy() for g in grads])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SCENARIOS) + [
    pytest.param(name, marks=pytest.mark.slow) for name in SLOW_SCENARIOS])
def test_a_split_layout_starts_from_the_checkpoints_weights_as_one_process(
        request, gpt_data, sources, shared, tmp_path_factory, name):
    slow = name in SLOW_SCENARIOS
    ranks, source, replicas, parallel, pipeline = (SLOW_SCENARIOS if slow else SCENARIOS)[name]
    root = request.getfixturevalue("slow_runs" if slow else "runs")
    origin = {"hf": "dense", "hf_moe": "moe"}.get(source, source)  # the same float32 weights
    key = ("init_split", origin, replicas)
    single, losses, grads = shared(key, lambda: reference(
        gpt_data, tmp_path_factory.mktemp("reference"), sources[origin], replicas,
        origin == "moe"))
    first = load(root / "out", name, 0)
    assert list(first["loss_steps"]) == [1, 2, 3, 4]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    if pipeline:  # a stage's rank holds its own weights: the stages' checkpoints, assembled
        model, _ = run_dir.load_model(str(root / name))
        single.recorded.assert_equal({v.path: v.numpy() for v in model.trainable_variables},
                                     err_msg=name)
    else:
        single.recorded.assert_equal(listed(first, "w"), err_msg=name)
        assert len(listed(first, "gradients")) == len(grads) > 10
        for ours, theirs in zip(listed(first, "gradients"), grads):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    log = read(root / "log.txt")
    assert f"weights from --init_checkpoint={sources[source]}" in log
