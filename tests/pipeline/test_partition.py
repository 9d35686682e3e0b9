"""Stage boundaries: exact balancing, overrides by index or name, errors, the printed plan."""
import itertools

import pytest

from tfbig.models.albert import AlbertConfig
from tfbig.models.bert import BertConfig
from tfbig.models.gpt import GPTConfig
from tfbig.pipeline.layers import layer_specs
from tfbig.pipeline.partition import (balanced_starts, estimate_memory, format_plan,
                                      live_microbatches, partition)

CONFIG = GPTConfig(vocab_size=320, seq_length=16, num_layers=6, hidden_size=32, num_heads=4)


def brute_force_best(weights, num_stages):
    """The smallest possible largest-stage sum, by trying every cut."""
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0,) + cuts + (n,)
        best = min(best, max(sum(weights[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("weights,num_stages", [
    ([5, 1, 1, 1, 1, 5], 2), ([1, 2, 3, 4, 5, 6, 7], 3), ([9, 1, 1, 1, 1, 1, 1, 9], 4),
    ([3, 3, 3, 3], 4), ([1, 100, 1, 1, 1], 3)])
def test_balanced_starts_minimise_the_largest_stage(weights, num_stages):
    starts = balanced_starts(weights, num_stages)
    edges = [0] + starts + [len(weights)]
    assert len(starts) == num_stages - 1 and all(b > a for a, b in zip(edges, edges[1:]))
    largest = max(sum(weights[a:b]) for a, b in zip(edges, edges[1:]))
    assert largest == brute_force_best(weights, num_stages)


def test_stage_params_add_up_to_the_model():
    specs = layer_specs(CONFIG, 16)
    for num_stages in (1, 2, 4, 8):
        plan = partition(specs, num_stages)
        assert sum(stage.params for stage in plan) == CONFIG.num_params()
        assert [n for stage in plan for n in stage.layer_names] == [s.name for s in specs]


@pytest.mark.parametrize("config", [
    AlbertConfig(vocab_size=320, seq_length=32, num_layers=4, num_groups=2, hidden_size=32,
                 num_heads=2, embedding_size=16),
    BertConfig(vocab_size=320, seq_length=32, num_layers=4, hidden_size=32, num_heads=2)],
    ids=["albert", "bert"])
def test_masked_lm_stage_params_add_up_to_the_model(config):
    specs = layer_specs(config, 32)
    assert sum(spec.params for spec in specs) == config.num_params()
    assert specs[-1].reads == ("embedding/word",)  # the MLM head's tied word table


def test_flops_balance_isolates_a_large_head_and_params_balance_a_large_embedding():
    # vocab 8000 x hidden 32: the output projection outweighs all blocks in FLOPs, and the
    # (tied) token table outweighs them in parameters.
    config = GPTConfig(vocab_size=8000, seq_length=16, num_layers=6, hidden_size=32, num_heads=4)
    by_flops = partition(layer_specs(config, 16), 2, balance="flops")
    assert by_flops[1].layer_names == ["head"]
    by_params = partition(layer_specs(config, 16), 2, balance="params")
    assert by_params[0].layer_names == ["embedding"]


def test_boundaries_by_index_and_by_name_agree():
    specs = layer_specs(CONFIG, 16)
    by_name = partition(specs, 3, boundaries="block_2,block_5")
    by_index = partition(specs, 3, boundaries="3, 6")
    assert [s.layer_names for s in by_name] == [s.layer_names for s in by_index]
    assert by_name[0].layer_names == ["embedding", "block_0", "block_1"]
    assert by_name[2].layer_names == ["block_5", "head"]


@pytest.mark.parametrize("boundaries,message", [
    ("block_2", "gives 1 boundaries; --pipeline_stages=3 needs 2"),
    ("block_4,block_2", "must increase strictly"),
    ("0,3", "must increase strictly"),
    ("block_2,block_99", "'block_99' is neither a layer index nor a layer name"),
])
def test_bad_boundaries_name_the_flag_and_the_value(boundaries, message):
    with pytest.raises(ValueError, match="--stage_boundaries") as error:
        partition(layer_specs(CONFIG, 16), 3, boundaries=boundaries)
    assert message in str(error.value)


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match=r"--pipeline_stages=9: the model has 8 layers"):
        partition(layer_specs(CONFIG, 16), 9)


def test_live_microbatches_and_memory_estimate():
    plan = partition(layer_specs(CONFIG, 16), 4)
    assert [live_microbatches("gpipe", s.index, 4, 8) for s in plan] == [8, 8, 8, 8]
    assert [live_microbatches("1f1b", s.index, 4, 8) for s in plan] == [4, 3, 2, 1]
    gpipe = estimate_memory(plan[0], "gpipe", 4, 8, 64, checkpointing=False)
    one_f_one_b = estimate_memory(plan[0], "1f1b", 4, 8, 64, checkpointing=False)
    recompute = estimate_memory(plan[0], "gpipe", 4, 8, 64, checkpointing=True)
    assert gpipe["weights"] == plan[0].params * 16
    assert gpipe["activations"] == 2 * one_f_one_b["activations"]  # 8 vs 4 micro-batches
    assert recompute["activations"] < gpipe["activations"]


def test_format_plan_lists_layers_params_and_memory():
    plan = partition(layer_specs(CONFIG, 16), 2)
    memory = [estimate_memory(s, "1f1b", 2, 4, 64, False) for s in plan]
    text = format_plan(plan, ["/device:CPU:0", "/device:CPU:1"], memory)
    lines = text.splitlines()
    assert len(lines) == 3 and "est. memory" in lines[0]
    assert "/device:CPU:1" in lines[2] and plan[1].layer_names[-1] in lines[2]
    assert "embedding" in lines[1] and "B = " in lines[1]
