"""The planner's MoE Llama: Mixtral 8x7B's published sizes (46.7B parameters, 12.9B active per
token), FLOPs from the active parameters only, the model state per rank under
--expert_parallel (the routed experts' weights, gradients and Adam state divided by the expert
group, the rest whole), the all-to-alls' bytes and time, and the search over expert degrees
where tfbig-train runs them."""
import dataclasses

import pytest

from tfbig.commands import plan as cli
from tfbig.models import shapes as models
from tfbig.models.llama import LlamaConfig
from tfbig.plan import estimate, speed

from .memory_probe import CPU
from .test_plan import plan


def test_mixtral_sizes_and_flops_count_the_active_experts():
    config = LlamaConfig.from_preset("mixtral-8x7b")
    assert config.num_params() == pytest.approx(46.70e9, rel=1e-3)
    assert config.active_params() == pytest.approx(12.88e9, rel=1e-3)
    dense = LlamaConfig.from_preset("mixtral-8x7b", num_experts=0)  # one expert-width MLP
    attention = 12 * 32 * 32 * 128 * 4096  # scores and weighted sums, PaLM's appendix B
    head = 6 * 4096 * 32000
    per_block = (config.flops_per_token(4096) - head - attention) / 32
    dense_block = (dense.flops_per_token(4096) - head - attention) / 32
    # a token multiplies by the router and k = 2 experts instead of one MLP
    assert per_block - dense_block == 6 * (4096 * 8 + 3 * 4096 * 14336)


@pytest.mark.parametrize("expert", [2, 8])
def test_expert_parallel_divides_the_experts_state_and_keeps_the_rest(expert):
    config = LlamaConfig.from_preset("mixtral-8x7b")
    shape = models.shape_of(config, "llama", 4096)
    assert shape.expert_params == 32 * 3 * 8 * 4096 * 14336
    whole = estimate.memory(shape, estimate.Layout(data=8), 1, "bf16", CPU)
    split = estimate.memory(shape, estimate.Layout(data=8, expert=expert), 1, "bf16", CPU)
    saved = shape.expert_params * (1 - 1 / expert)
    for kind, bytes_per_param in (("parameters", 4), ("gradients", 4), ("optimizer", 8)):
        assert whole[kind] - split[kind] == pytest.approx(bytes_per_param * saved, rel=1e-9)
    assert split["activations"] == whole["activations"]
    assert estimate.Layout(data=8, expert=expert).describe().startswith(f"D8 P1 E{expert} T1")


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_beside_experts_slices_the_other_weights_state_and_keeps_the_experts(stage):
    """EP x ZeRO-1/2 (tfbig.distribute.expert_zero): the replicated weights' optimizer state
    (master copy + moments: 12 bytes) over the partition group, with stage 2 their gradients
    too; a rank's E/N experts keep 4 + 4 + 8 bytes each (moments whole, no master copy)."""
    shape = models.shape_of(LlamaConfig.from_preset("mixtral-8x7b"), "llama", 4096)
    layout = estimate.Layout(data=8, expert=2, zero_stage=stage, shard_degree=4)
    held = estimate.memory(shape, layout, 1, "bf16", CPU)
    experts = shape.expert_params / 2
    dense = shape.params - shape.expert_params
    assert estimate.expert_params_held(shape, layout) == experts
    assert held["parameters"] == pytest.approx(4 * (dense + experts), rel=1e-12)
    assert held["optimizer"] == pytest.approx(12 * dense / 4 + 8 * experts, rel=1e-12)
    assert held["gradients"] == pytest.approx(4 * dense / (4 if stage == 2 else 1)
                                              + 4 * experts, rel=1e-12)


def mixtral_plan(argv):
    return plan(["--model=llama", "--preset=mixtral-8x7b", "--gpu=H100-80GB", "--nodes=4",
                 "--seq_length=4096", "--batch_size=256"] + argv)


def test_expert_all_to_alls_are_timed_per_moe_layer_and_micro_batch():
    """Each MoE layer sends every token's k rows to their experts and back, forward and
    backward (and again in a recomputed forward): 4 (6) all-to-alls of k x tokens x hidden
    values over the N ranks of the expert group, each as long as a reduce-scatter of as many
    bytes; none without expert parallelism or experts."""
    values, _, found = mixtral_plan(["--expert_parallel=8", "--num_microbatches=2",
                                     "--activation_checkpointing=false"])
    best = found[0]
    shape, cluster = cli.shape_from_flags(values), cli.cluster_from_flags(values)
    rows = best.micro_batch * 4096 * 2 * 4096 * 2  # tokens x k x hidden, bf16
    one = cluster.collective_time(rows, 8, 1, passes=1)
    assert one > 0
    ticks = best.layout.num_microbatches  # no pipeline: one tick per micro-batch
    assert best.time["expert"] == pytest.approx(ticks * 32 * 4 * one, rel=1e-12)
    recomputed = dataclasses.replace(best.layout, activation_checkpointing=True)
    again = speed.step_time(shape, recomputed, best.micro_batch, "mixed_bfloat16", cluster)
    assert again["expert"] == pytest.approx(ticks * 32 * 6 * one, rel=1e-12)
    alone = dataclasses.replace(best.layout, expert=1)
    assert speed.step_time(shape, alone, best.micro_batch, "mixed_bfloat16",
                           cluster)["expert"] == 0.0
    dense = dataclasses.replace(shape, num_experts=0, experts_per_token=0)
    assert speed.step_time(dense, best.layout, best.micro_batch, "mixed_bfloat16",
                           cluster)["expert"] == 0.0


def test_the_search_offers_expert_parallelism_where_tfbig_train_runs_it():
    _, _, found = mixtral_plan([])
    degrees = {e.layout.expert for e in found}
    assert degrees == {1, 2, 4, 8}
    for e in found:
        if e.layout.expert > 1:  # inside data (ZeRO, TP, PP or CP), N dividing the data ranks
            layout = e.layout
            assert layout.data % layout.expert == 0
            # not TP with PP, nor TP with ZeRO-3 (tfbig.layouts.composition); PP with ZeRO-1
            assert not (layout.tensor > 1 and layout.pipeline > 1), layout
            assert not (layout.tensor > 1 and layout.zero_stage == 3), layout
            assert not (layout.pipeline > 1 and layout.zero_stage > 1), layout
    assert {e.layout.zero_stage for e in found if e.layout.expert > 1} == {0, 1, 2, 3}
    assert any(e.layout.expert > 1 and e.layout.pipeline > 1 and e.layout.zero_stage == 1
               for e in found)
    assert any(e.layout.expert > 1 and e.layout.tensor > 1 for e in found)
    assert any(e.layout.expert > 1 and e.layout.tensor > 1 and e.layout.zero_stage in (1, 2)
               for e in found)  # Megatron's recipe: EP x TP x a distributed optimizer
    _, _, dense = plan(["--preset=1.3b", "--nodes=2", "--batch_size=512"])
    assert {e.layout.expert for e in dense} == {1}


def test_the_report_gives_active_and_total_parameters(capsys):
    assert cli.main(["tfbig-plan", "--model=llama", "--preset=mixtral-8x7b", "--nodes=4",
                     "--gpu=H100-80GB", "--expert_parallel=8", "--seq_length=4096",
                     "--batch_size=256", "--num_microbatches=1"]) == 0
    out = capsys.readouterr().out
    assert ("46.7B parameters (12.9B active: 2 of 8 experts per token; FLOPs and MFU count "
            "the active ones)") in out
    shape = models.shape_of(LlamaConfig.from_preset("mixtral-8x7b", seq_length=4096), "llama",
                            4096)
    sent = 8 * 4096 * 2 * 4096 * 2  # 8 sequences x tokens x k x hidden, bf16
    assert speed.expert_exchange_bytes(shape, estimate.Layout(data=32, expert=8), 8,
                                       "mixed_bfloat16") == sent
    assert (f"experts over 8 ranks: {sent / 1e6:.3g} MB of rows per rank in each all-to-all, 4 "
            "per MoE layer and micro-batch") in out


def test_expert_parallel_flags_tfbig_train_cannot_run_are_named():
    with pytest.raises(ValueError) as error:
        mixtral_plan(["--expert_parallel=3"])
    assert str(error.value) == ("--expert_parallel=3 does not divide the model's num_experts=8; "
                                "choose one of [1, 2, 4, 8]")


@pytest.mark.parametrize("argv, message", [
    (["--expert_parallel=2", "--pipeline_stages=2", "--tensor_parallel=2"],
     "--expert_parallel=2 with --pipeline_stages=2 and --tensor_parallel=2 is not supported: "
     "expert parallelism "
     "composes with each of these, not yet with both at once; drop one of them"),
    (["--expert_parallel=2", "--tensor_parallel=2", "--zero_stage=3"], "--expert_parallel=2 "
     "with --tensor_parallel=2 and --zero_stage=3 is not supported: expert and tensor "
     "parallelism compose with ZeRO-1 and -2 (the optimizer state sliced), not yet with stage "
     "3's weights gathered per layer; use --zero_stage=1 or 2"),
])
def test_fixed_pairs_tfbig_train_refuses_are_estimated_and_named(argv, message):
    """A pair tfbig-train refuses (tfbig.layouts.composition) is never searched; fixed by the
    flags, it is estimated as asked and each layout says tfbig-train refuses it."""
    estimates = mixtral_plan(argv)[2]
    assert estimates and all(e.to_dict()["refused"] == message for e in estimates)
    free = mixtral_plan([])[2]
    assert any(e.layout.expert > 1 for e in free)
    assert all(e.to_dict()["refused"] is None for e in free)


def test_expert_parallel_on_a_dense_model_is_named():
    with pytest.raises(ValueError) as error:
        plan(["--preset=1.3b", "--nodes=2", "--expert_parallel=2"])
    assert str(error.value) == ("--expert_parallel=2: the model has no MoE layers; choose an "
                                "MoE preset (tiny-moe, mixtral-8x7b)")
