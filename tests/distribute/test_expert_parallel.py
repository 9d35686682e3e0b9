"""--expert_parallel on real `horovodrun --gloo` launches: a tiny MoE Llama (--preset=tiny-moe:
4 experts, top-2, hidden 32, 2 layers, dropless) with its experts split over the ranks equals
one process reading, per step, exactly the examples all ranks read together, as one
micro-batch per data-parallel replica (the router losses are each replica's micro-batch's:
tfbig.tasks.llama): losses over 4 steps at rtol 1e-5, final weights by tests/equality.py's
rule, first-step gradients of the routers and experts, the evaluation loss. Each rank holds
half (EP2) or a quarter (EP4) of the experts and the replicated rest bit-identical to the other
ranks; the per-expert token counts reach the progress line; a run resumed from its per-rank
expert checkpoints continues exactly.

With --zero_stage=1|2|3 (tfbig.distribute.expert_zero) the optimizer state (stage 3: and the
weights) of every weight but the experts is sliced over the partition group, the experts' kept
whole on their ranks. With
--tensor_parallel=2 (tfbig.distribute.expert_tensor) each replica's attention and vocabulary
are split over a tensor group and the experts over the expert groups of each tensor rank.

Default run: EP2 on 2 ranks and EP2 started from a single-device checkpoint, in one launch with
the refusals (--sequence_parallel of the MoE model: in-process). Slow: EP2 x TP2 on 4 ranks
(resumed), EP2 with --activation_checkpointing (its blocks recomputed in the backward, the
all-to-alls with them) and EP2 x ZeRO-3 (resumed) in a 2-rank launch, EP2 x TP2 from a
single-device checkpoint and with an fp16 overflow, TP2 and TP2 x ZeRO-1 of the MoE model (a
4-rank launch), the resumed run (a launch of its own), EP2 x DP2 and EP4 on 4 ranks, EP2 x DP2
with ZeRO-1 and -3 over a partition group of 4 and ZeRO-2 over MiCS groups of 2, ZeRO-3 of the
MoE model without expert parallelism, the MoE model under --context_parallel=2 alone and with
EP2 (resumed), and EP2 x CP2 x TP2 on 8 ranks."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from equality import GRADIENT_ATOL, GRADIENT_RTOL, RecordedGradients  # noqa: E402
from test_horovod import (EQUIVALENCE, WORKER, horovod_cfg, horovodrun, listed,  # noqa: E402
                          load, read, run_entry)
from test_trainer import ReplicasTask, make_cfg  # noqa: E402

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig.convert.run_dir import load_model  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.training.consolidate import consolidate  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

# eval_steps=1: one validation batch of micro-batch x replicas records (the whole split costs
# ~20 s a fit); the reference, with micro-batches of the replicas' size, reads as many in
# `replicas` batches
MOE = dict(model="llama", preset="tiny-moe", num_layers=0, hidden_size=0, num_heads=0,
           eval_steps=1)
EXPERT_WEIGHTS = ("/mlp/experts/gate", "/mlp/experts/up", "/mlp/experts/down")


def ep_cfg(gpt_data, model_dir, expert, recompute=False, zero_stage=0, shard_degree=0,
           tensor=1, **train):
    cfg = horovod_cfg(gpt_data, model_dir, **{**MOE, **train})
    cfg.parallel.expert_parallel, cfg.parallel.tensor_parallel = expert, tensor
    cfg.parallel.zero_stage, cfg.parallel.shard_degree = zero_stage, shard_degree
    cfg.pipeline.activation_checkpointing = recompute
    return cfg


def launch(root, plan, ranks):
    """One launch of horovod_worker.py on `ranks` processes; {name: [rank results]}."""
    import json

    os.makedirs(root / "out")
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt",
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                      ranks=("-np", str(ranks), "-H", f"localhost:{ranks}"))
    output = read(root / "log.txt")
    assert code == 0, output[-6000:]
    return {run["name"]: [load(root / "out", run["name"], r) for r in range(ranks)]
            for run in plan}, output


def reference(data_dir, model_dir, replicas, **train):
    """One process reading every replica's batch, one micro-batch each; (trainer, losses)."""
    cfg = make_cfg(data_dir, model_dir, **{**EQUIVALENCE, **MOE, "grad_accum_steps": replicas,
                                           "eval_steps": replicas, **train})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    trainer = Trainer(cfg, task=ReplicasTask(cfg.train, replicas, get_task(cfg.train, cfg)),
                      logger=logger)
    trainer.recorded = RecordedGradients(trainer)
    trainer.fit()
    return trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)])


def check_equal_to_one_process(results, single, losses, expert, tensor=1):
    first = results[0]
    assert first["num_replicas"] * tensor == len(results)
    assert first["step"] == EQUIVALENCE["max_steps"]
    for other in results[1:]:  # the full weights (experts gathered) and losses agree
        for key in [k for k in first if k[0] == "w" and k[1:].isdigit()]:
            np.testing.assert_array_equal(first[key], other[key], err_msg=key)
        np.testing.assert_array_equal(first["losses"], other["losses"])
    assert np.all(first["grad_norms"] > EQUIVALENCE["grad_clip_norm"])  # clipping is active
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    paths = single.recorded.paths
    assert len(paths) == len(listed(first, "w"))
    for path, ours in zip(paths, listed(first, "w")):
        single.recorded.assert_equal_piece(path, ours, err_msg=path)
    routed = [i for i, p in enumerate(paths) if "/mlp/router" in p or p.endswith(EXPERT_WEIGHTS)]
    assert len(routed) == 2 * 4
    reference_gradients = single.recorded.gradients()[0]
    for i in routed:
        ours, theirs = listed(first, "gradients")[i], reference_gradients[i]
        assert np.abs(theirs).max() > 1e-4, paths[i]
        np.testing.assert_allclose(ours, theirs, rtol=GRADIENT_RTOL, atol=GRADIENT_ATOL,
                                   err_msg=paths[i])
    assert float(first["eval_loss"]) == pytest.approx(single.evaluate()["loss"], rel=1e-5)
    for result in results:  # E/N experts on each rank (2 layers x 3 x (4, 32, 64) float32)
        assert result.get("bytes_expert_parameters", 2 * 3 * 4 * 32 * 64 * 4) * expert == (
            2 * 3 * 4 * 32 * 64 * 4)


def refused(gpt_data, root, name, expert=2, moe=None, **train):
    """A run the ranks must refuse (horovod_worker's expect_error)."""
    cfg = horovod_cfg(gpt_data, root / name, **{**MOE, **train})
    cfg.parallel.expert_parallel = expert
    for key, value in (moe or {}).items():
        setattr(cfg.moe, key, value)
    return run_entry(name, cfg, root / "out", expect_error=True)


# Refused on the ranks (the model's MoE layers are known once it is built), before anything is
# written; what is refused before Horovod starts: tests/test_moe_train.py.
REFUSED = {"indivisible": "--expert_parallel=2: the 3 experts of llama/block_0/mlp do not "
                          "split over 2 ranks",
           "dense": "--expert_parallel=2: Llama has no MoE layers"}


@pytest.fixture(scope="module")
def ep2(gpt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    reference(gpt_data, root / "from_one", 2, max_steps=2)  # a single-device checkpoint
    results, output = launch(root, [
        refused(gpt_data, root, "indivisible", moe={"num_experts": 3}),
        refused(gpt_data, root, "dense", preset="tiny"),
        run_entry("ep2", ep_cfg(gpt_data, root / "ep2", 2), root / "out", first_gradients=True),
        run_entry("from_one", ep_cfg(gpt_data, root / "from_one", 2), root / "out")],
        ranks=2)
    return results, output, root


@pytest.fixture(scope="module")
def ep2_slow(gpt_data, tmp_path_factory):
    """A 2-rank launch of its own (slow): EP2 with --activation_checkpointing and EP2 x ZeRO-3
    (resumed), with the refused resumes of its pieces."""
    root = tmp_path_factory.mktemp("expert_parallel_slow")
    results, output = launch(root, [
        run_entry("ep2_recompute", ep_cfg(gpt_data, root / "ep2_recompute", 2, recompute=True),
                  root / "out", first_gradients=True),
        run_entry("ep2_zero3", ep_cfg(gpt_data, root / "ep2_zero3", 2, zero_stage=3),
                  root / "out", first_gradients=True, interrupt_at=2),
        # the ZeRO pieces resumed without --zero_stage or with another stage: refused before
        # anything is restored
        run_entry("ep2_zero3_as_ep2", ep_cfg(gpt_data, root / "ep2_zero3", 2), root / "out",
                  expect_error=True),
        run_entry("ep2_zero3_as_zero1", ep_cfg(gpt_data, root / "ep2_zero3", 2, zero_stage=1),
                  root / "out", expect_error=True)],
        ranks=2)
    return results, output, root


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_expert_parallelism_cannot_split_is_refused_by_name_on_every_rank(ep2, name):
    for result in ep2[0][name]:
        assert str(result["error"]).startswith(REFUSED[name]), result["error"]
        assert not result["model_dir_exists"]


@pytest.mark.multiproc
def test_two_expert_ranks_equal_one_process(ep2, gpt_data, shared, tmp_path_factory):
    results, output, root = ep2
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    check_equal_to_one_process(results["ep2"], single, losses, 2)
    assert "expert groups of 2: [(0, 1)]" in output
    assert "expert tokens" in output and "(min/mean/max)" in output
    # the run's per-rank expert checkpoints read back as one single-device model
    model, _ = load_model(str(root / "ep2"))
    for v, ours in zip(model.trainable_variables, listed(results["ep2"][0], "w"), strict=True):
        np.testing.assert_array_equal(v.numpy(), ours, err_msg=v.path)


@pytest.mark.slow  # EP alone and recompute alone (test_recompute's MoE case): default
@pytest.mark.multiproc
def test_recomputed_blocks_with_their_all_to_alls_equal_one_process(ep2, ep2_slow, gpt_data,
                                                                    shared, tmp_path_factory):
    """--activation_checkpointing: every rank recomputes its blocks in the backward, the
    MoE layers' all-to-alls again with them (in the same order on every rank): the same
    result as one process (which does not recompute)."""
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    check_equal_to_one_process(ep2_slow[0]["ep2_recompute"], single, losses, 2)
    assert [int(r["recomputed_layers"]) for r in ep2_slow[0]["ep2_recompute"]] == [2, 2]
    assert [int(r["recomputed_layers"]) for r in ep2[0]["ep2"]] == [0, 0]


def check_zero_over_the_other_weights(results, single, shards, stage):
    """Each rank's master slices are its partition position's of the replicated weights (1/
    `shards` of each, padded), its Adam moments those slices' and its own experts' whole;
    with stage 3 those slices are the replicated weights' only copy on the rank."""
    ceil = lambda n: -(-n // shards)  # noqa: E731
    replicated = [v for v in single.model.trainable_variables
                  if not v.path.endswith(EXPERT_WEIGHTS)]
    master = sum(4 * ceil(int(np.prod(v.shape))) for v in replicated)
    whole = 4 * sum(int(np.prod(v.shape)) for v in replicated)
    for result in results:
        assert int(result["bytes_master_slices"]) == master
        assert int(result["bytes_optimizer_slots"]) == 2 * (
            master + int(result["bytes_expert_parameters"]))
        assert int(result["bytes_replicated_parameters"]) == (0 if stage == 3 else whole)
        assert int(result["bytes_parameters"]) == int(result["bytes_expert_parameters"]) + (
            0 if stage == 3 else whole)


@pytest.mark.slow  # EP alone and ZeRO-3 alone: default
@pytest.mark.multiproc
def test_zero3_over_the_replicated_weights_of_two_expert_ranks_equals_one_process(
        ep2_slow, gpt_data, shared, tmp_path_factory):
    """--expert_parallel=2 --zero_stage=3, stopped after 2 steps and resumed from its pieces:
    the one process's losses, weights and first gradients; every weight but the experts held
    as a half slice on each rank, gathered per block (the experts whole, the all-to-alls
    recomputed with the block); the pieces read back as one model; resuming them without
    --zero_stage or with stage 1, and consolidating them, are refused by name."""
    results, _, root = ep2_slow
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    run = results["ep2_zero3"]
    assert int(run[0]["restored_step"]) == 2
    check_equal_to_one_process(run, single, losses, 2)
    check_zero_over_the_other_weights(run, single, 2, 3)
    model, _ = load_model(str(root / "ep2_zero3"))
    for v, ours in zip(model.trainable_variables, listed(run[0], "w"), strict=True):
        np.testing.assert_array_equal(v.numpy(), ours, err_msg=v.path)
    for result in results["ep2_zero3_as_ep2"]:
        assert "was written with --expert_parallel and --zero_stage" in str(result["error"])
    for result in results["ep2_zero3_as_zero1"]:
        assert "holds a checkpoint of --expert_parallel=2 --zero_stage=3 --shard_degree=2" in \
            str(result["error"])
    with pytest.raises(ValueError, match="was written with --expert_parallel"):
        consolidate(str(root / "ep2_zero3"), str(tmp_path_factory.mktemp("consolidated")))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("stage, shards, expert", [(1, 4, 2), (2, 2, 2), (3, 4, 2), (3, 2, 1)])
def test_zero_partition_groups_across_expert_groups_equal_one_process(
        stage, shards, expert, gpt_data, shared, tmp_path_factory):
    """4 ranks, EP2 x DP2, resumed from their pieces: ZeRO-1 and -3 over one partition group
    of 4 (spanning both expert groups: lcm(4, 2) = 4 pieces) and ZeRO-2 over MiCS groups of 2
    (each an expert group; their replicas hold the same slices and experts: 2 pieces); and
    ZeRO-3 of the MoE model without expert parallelism (every expert sliced and gathered)
    over MiCS groups of 2."""
    root = tmp_path_factory.mktemp(f"expert_zero{stage}")
    results, output = launch(root, [run_entry(
        "ep", ep_cfg(gpt_data, root / "ep", expert, zero_stage=stage, shard_degree=shards),
        root / "out", first_gradients=True, interrupt_at=2)], ranks=4)
    single, losses = shared(("moe", 4), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference4"), 4))
    assert [int(r["restored_step"]) for r in results["ep"]] == [2] * 4
    check_equal_to_one_process(results["ep"], single, losses, expert)
    model, _ = load_model(str(root / "ep"))
    for v, ours in zip(model.trainable_variables, listed(results["ep"][0], "w"), strict=True):
        np.testing.assert_array_equal(v.numpy(), ours, err_msg=v.path)
    if expert == 1:
        return
    check_zero_over_the_other_weights(results["ep"], single, shards, stage)
    assert "expert groups of 2" in output
    assert sorted(os.listdir(root / "ep" / "expert")) == [f"rank-{r}" for r in range(1, shards)]


@pytest.mark.slow
@pytest.mark.multiproc
def test_sequences_split_over_context_ranks_equal_one_process(gpt_data, shared,
                                                              tmp_path_factory):
    """4 ranks = data 2 x context 2: the MoE model under --context_parallel=2 alone, with
    --expert_parallel=2 (an expert group: the 2 data ranks of one context position) and with
    ZeRO-1 too. Each router's statistics are summed over the context group, so the
    load-balancing loss is the replica's whole batch's as on one process; a capacity factor is
    refused by name."""
    root = tmp_path_factory.mktemp("expert_context")
    runs = {name: ep_cfg(gpt_data, root / name, expert, zero_stage=stage)
            for name, expert, stage in (("cp2", 1, 0), ("ep2_cp2", 2, 0),
                                        ("ep2_cp2_zero1", 2, 1), ("capacity", 2, 0))}
    for cfg in runs.values():
        cfg.parallel.context_parallel = 2
    runs["capacity"].moe.capacity_factor = 1.0
    results, output = launch(root, [run_entry(name, cfg, root / "out", first_gradients=True,
                                              interrupt_at=2 if name == "ep2_cp2" else 0,
                                              expect_error=name == "capacity", norm_rows=True)
                                    for name, cfg in runs.items()], ranks=4)
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    # 2 context ranks per data replica
    for name, expert in (("cp2", 1), ("ep2_cp2", 2), ("ep2_cp2_zero1", 2)):
        check_equal_to_one_process(results[name], single, losses, expert, tensor=2)
        # each rank's norms see its 2 chunks of 4 of the 16 positions
        assert [int(r["norm_rows"]) for r in results[name]] == [8] * 4
    assert int(results["ep2_cp2"][0]["restored_step"]) == 2
    assert "expert groups of 2: [(0, 2), (1, 3)]" in output
    for result in results["capacity"]:
        assert str(result["error"]).startswith("--context_parallel with --capacity_factor=1")
        assert not result["model_dir_exists"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_experts_with_the_sequence_and_the_attention_split_equal_one_process(
        gpt_data, shared, tmp_path_factory):
    """8 ranks = data 2 x context 2 x tensor 2 with --expert_parallel=2: each replica's
    sequences split over a context group, its attention over a tensor group, and the experts
    over the expert groups of the data ranks of one (context, tensor) place; the one process's
    losses, weights and first gradients of the routers and experts."""
    root = tmp_path_factory.mktemp("expert_context_tensor")
    cfg = ep_cfg(gpt_data, root / "ep2_cp2_tp2", 2, tensor=2)
    cfg.parallel.context_parallel = 2
    results, output = launch(root, [run_entry("ep2_cp2_tp2", cfg, root / "out",
                                              first_gradients=True)], ranks=8)
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    check_equal_to_one_process(results["ep2_cp2_tp2"], single, losses, 2, tensor=4)
    assert "expert groups of 2" in output


def check_steps_3_and_4_are_the_one_process(results, single, losses):
    """A run started from the one process's step-2 checkpoint logs its steps 3-4 and ends with
    its weights (every rank the same)."""
    first = results[0]
    assert list(first["loss_steps"]) == [3, 4]
    np.testing.assert_allclose(first["losses"], losses[2:], rtol=1e-5)
    for path, ours in zip(single.recorded.paths, listed(first, "w"), strict=True):
        single.recorded.assert_equal_piece(path, ours, err_msg=path)
    for other in results[1:]:
        np.testing.assert_array_equal(listed(other, "w")[0], listed(first, "w")[0])


@pytest.fixture(scope="module")
def ep2_tp2(gpt_data, tmp_path_factory):
    """One 4-rank launch (slow): EP2 x TP2 (resumed from its pieces), with ZeRO-1 (resumed
    from its pieces) and ZeRO-2, and --sequence_parallel refused on every rank."""
    root = tmp_path_factory.mktemp("expert_tensor")
    sequence = ep_cfg(gpt_data, root / "sequence", 2, tensor=2)
    sequence.parallel.sequence_parallel = True
    results, output = launch(root, [
        run_entry("ep2_tp2", ep_cfg(gpt_data, root / "ep2_tp2", 2, tensor=2), root / "out",
                  first_gradients=True, interrupt_at=2),
        run_entry("ep2_tp2_zero1", ep_cfg(gpt_data, root / "ep2_tp2_zero1", 2, tensor=2,
                                          zero_stage=1), root / "out", first_gradients=True,
                  interrupt_at=2),
        run_entry("ep2_tp2_zero2", ep_cfg(gpt_data, root / "ep2_tp2_zero2", 2, tensor=2,
                                          zero_stage=2), root / "out", first_gradients=True),
        run_entry("sequence", sequence, root / "out", expect_error=True)], ranks=4)
    return results, output, root


@pytest.fixture(scope="module")
def ep2_tp2_slow(gpt_data, tmp_path_factory):
    """A 4-rank launch of its own (slow): TP2 of the MoE model alone (its experts whole on
    both tensor ranks) and with ZeRO-1, EP2 x TP2 from a single-device checkpoint and with an
    fp16 overflow in one rank's experts."""
    root = tmp_path_factory.mktemp("expert_tensor_slow")
    reference(gpt_data, root / "from_one", 2, max_steps=2)  # a single-device checkpoint
    fp16 = dict(precision="mixed_float16", max_steps=2)
    results, output = launch(root, [
        run_entry("tp2", ep_cfg(gpt_data, root / "tp2", 1, tensor=2), root / "out",
                  first_gradients=True),
        run_entry("tp2_zero1", ep_cfg(gpt_data, root / "tp2_zero1", 1, tensor=2, zero_stage=1),
                  root / "out", first_gradients=True),
        run_entry("from_one", ep_cfg(gpt_data, root / "from_one", 2, tensor=2), root / "out"),
        run_entry("fp16_skip", ep_cfg(gpt_data, root / "fp16", 2, tensor=2, **fp16),
                  root / "out", poison_gradient_rank=3)], ranks=4)
    return results, output, root


def test_sequence_parallelism_of_an_moe_model_is_refused_by_name():
    """The routers' losses are over a replica's whole batch: the tensor layout refuses
    --sequence_parallel for the MoE Llama when it splits the model (on every rank, before
    anything is written: the slow EP2 x TP2 launch)."""
    from tfbig.layouts.tensor_layout import split_model
    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.models.llama import Llama
    from tfbig.models.llama_config import LlamaConfig

    class MoETask:
        seq_length = 16

        def build_model(self):
            model = Llama(LlamaConfig.from_preset("tiny-moe", vocab_size=320))
            model.build((None, self.seq_length))
            return model

    with pytest.raises(ValueError, match="no sequence-parallel plan for Llama.*"
                                         "an MoE Llama has none"):
        split_model(MoETask(), TensorGroup(None, 0, 2, True))


@pytest.mark.slow  # EP2 alone (a launch of 2 ranks) and TP2 alone: default
@pytest.mark.multiproc
def test_experts_over_expert_groups_with_the_attention_split_equal_one_process(
        ep2_tp2, gpt_data, shared, tmp_path_factory):
    """--expert_parallel=2 --tensor_parallel=2 on 4 ranks (2 data replicas, each a tensor
    group), stopped after 2 steps and resumed from its (tensor rank, expert rank) pieces: the
    one process's losses, weights and first gradients of routers and experts; the pieces read
    back as one model. The routers' losses are over a replica's whole batch, so
    --sequence_parallel is refused by name."""
    results, output, root = ep2_tp2
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    run = results["ep2_tp2"]
    assert [int(r["restored_step"]) for r in run] == [2] * 4
    check_equal_to_one_process(run, single, losses, 2, tensor=2)
    assert "expert groups of 2: [(0, 2), (1, 3)]" in output
    for result in run:  # the attention's q, k, v and proj halved; the experts' halved too
        assert 0 < int(result["bytes_split_parameters"])
        assert int(result["bytes_expert_parameters"]) == 2 * 3 * 2 * 32 * 64 * 4
    assert sorted(os.listdir(root / "ep2_tp2" / "tensor" / "rank-1" / "expert")) == ["rank-1"]
    model, _ = load_model(str(root / "ep2_tp2"))
    for v, ours in zip(model.trainable_variables, listed(run[0], "w"), strict=True):
        np.testing.assert_array_equal(v.numpy(), ours, err_msg=v.path)
    for result in results["sequence"]:
        assert "--sequence_parallel: no sequence-parallel plan for Llama" in str(
            result["error"])
        assert "an MoE Llama has none" in str(result["error"])
        assert not result["model_dir_exists"]


@pytest.mark.slow  # EP2 alone, TP2 alone, EP2 x ZeRO and TP2 x ZeRO: default or slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ep2_tp2_zero1", "ep2_tp2_zero2"])
def test_experts_tensor_slices_and_zero_slices_together_equal_one_process(
        ep2_tp2, gpt_data, shared, tmp_path_factory, name):
    """--expert_parallel=2 --tensor_parallel=2 --zero_stage=1 (stopped after 2 steps and
    resumed from its pieces) and 2 on 4 ranks: each tensor rank's non-expert optimizer state
    sliced over its 2 data ranks, its experts whole; the one process's losses, weights and
    first gradients of routers and experts."""
    results, _, root = ep2_tp2
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    run = results[name]
    check_equal_to_one_process(run, single, losses, 2, tensor=2)
    if name.endswith("zero1"):
        assert [int(r["restored_step"]) for r in run] == [2] * 4
    layout = json.loads((root / name / "zero.json").read_text())
    assert (layout["expert_parallel"], layout["tensor_parallel"]) == (2, 2)
    for result in run:  # half of the tensor rank's non-expert master weights (slices padded
        # to equal sizes), none of its experts'
        master, split = int(result["bytes_master_slices"]), int(result["bytes_split_parameters"])
        whole = int(result["bytes_replicated_parameters"])
        assert master == pytest.approx((split + whole) / 2, rel=0.02), (master, split, whole)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_moe_model_under_tensor_parallelism_alone_equals_one_process(
        ep2_tp2_slow, gpt_data, shared, tmp_path_factory):
    """--tensor_parallel=2 of the MoE model without expert parallelism (every expert on both
    tensor ranks), with and without ZeRO-1: the one process's losses, weights, gradients."""
    results = ep2_tp2_slow[0]
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    check_equal_to_one_process(results["tp2"], single, losses, 1, tensor=2)
    check_equal_to_one_process(results["tp2_zero1"], single, losses, 1, tensor=2)


@pytest.mark.slow
@pytest.mark.multiproc
def test_expert_tensor_layout_starts_from_one_device_and_skips_overflows_everywhere(
        ep2_tp2_slow, gpt_data, shared, tmp_path_factory):
    """From the one process's step-2 checkpoint, each rank cuts its tensor slices and its
    experts: steps 3-4 are the one process's. fp16: an overflow in rank 3's experts only
    skips the step on all 4 ranks (nothing changes, the scale halves alike)."""
    from test_zero import check_the_poisoned_step_is_skipped_on_all

    results, _, root = ep2_tp2_slow
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    check_steps_3_and_4_are_the_one_process(results["from_one"], single, losses)
    check_the_poisoned_step_is_skipped_on_all(root / "out", "fp16_skip")


@pytest.mark.multiproc
def test_a_single_device_checkpoint_starts_an_expert_parallel_run(ep2, gpt_data, shared,
                                                                  tmp_path_factory):
    """The one process's checkpoint after 2 steps (as a converted or consolidated checkpoint
    is: no expert.json), resumed under --expert_parallel=2: each rank cuts its experts and
    their Adam slots from it, and steps 3-4 are the one process's."""
    single, losses = shared(("moe", 2), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference"), 2))
    check_steps_3_and_4_are_the_one_process(ep2[0]["from_one"], single, losses)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_resumed_expert_parallel_run_continues_exactly(ep2, gpt_data, tmp_path_factory):
    """Fit 2 steps, save each rank's experts, resume with a new Trainer, fit to 4: the run
    without the interruption (the default launch's) is matched."""
    root = tmp_path_factory.mktemp("expert_parallel_resumed")
    results, _ = launch(root, [run_entry("ep2_resumed", ep_cfg(gpt_data, root / "resumed", 2),
                                         root / "out", interrupt_at=2)], ranks=2)
    plain, resumed = ep2[0]["ep2"][0], results["ep2_resumed"]
    assert int(resumed[0]["restored_step"]) == 2
    np.testing.assert_allclose(resumed[0]["losses"], plain["losses"], rtol=1e-6)
    for key in [k for k in plain if k[0] == "w" and k[1:].isdigit()]:
        np.testing.assert_allclose(resumed[1][key], plain[key], rtol=1e-6, atol=1e-7,
                                   err_msg=key)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("expert", [2, 4])
def test_four_ranks_with_experts_split_in_twos_or_fours_equal_one_process(
        expert, gpt_data, shared, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"expert_parallel_{expert}x{4 // expert}")
    results, output = launch(root, [run_entry(
        "ep", ep_cfg(gpt_data, root / "ep", expert), root / "out", first_gradients=True)],
        ranks=4)
    single, losses = shared(("moe", 4), lambda: reference(
        gpt_data, tmp_path_factory.mktemp("moe_reference4"), 4))
    check_equal_to_one_process(results["ep"], single, losses, expert)
    assert f"expert groups of {expert}" in output


@pytest.mark.parametrize("layout_file, flag", [("zero.json", "--zero_stage"),
                                               ("tensor.json", "--tensor_parallel"),
                                               ("pipeline.json", "--pipeline_stages")])
def test_another_layouts_pieces_are_not_taken_for_a_single_device_checkpoint(
        tmp_path, layout_file, flag):
    from types import SimpleNamespace

    from tfbig.distribute.expert_parallel import ExpertParallelStrategy
    from tfbig.layouts import stage_checkpoint, tensor_layout, zero_checkpoint

    assert {zero_checkpoint.LAYOUT_FILE, tensor_layout.LAYOUT_FILE,
            stage_checkpoint.LAYOUT_FILE} == {"zero.json", "tensor.json", "pipeline.json"}
    ExpertParallelStrategy._refuse_other_pieces(SimpleNamespace(size=2), str(tmp_path))
    (tmp_path / layout_file).write_text('{"zero_stage": 1, "shard_degree": 2, '
                                        '"tensor_parallel": 2, "splits": {}, '
                                        '"pipeline_stages": 2}')
    with pytest.raises(ValueError) as error:
        ExpertParallelStrategy._refuse_other_pieces(SimpleNamespace(size=2), str(tmp_path))
    assert str(error.value).startswith(f"--model_dir={tmp_path} was written with {flag} "
                                       f"({layout_file}): --expert_parallel=2 starts from a "
                                       f"single-device checkpoint only")
