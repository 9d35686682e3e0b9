"""Stage boundaries: exact balancing, overrides by index or name, errors, the printed plan."""
import itertools

import pytest

from tfbig.config import PipelineConfig
from tfbig.models.albert import AlbertConfig
from tfbig.models.bert import BertConfig
from tfbig.models.gpt import GPTConfig
from tfbig.models.shapes import layer_specs
from tfbig.layouts.partition import balanced_starts, format_plan, partition
from tfbig.pipeline.strategy import stage_memory

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


def exhaustive_dp_starts(weights, num_stages):
    """The cuts of the full DP (every j for every stage end), earliest among equal ones: what
    balanced_starts returned before it stopped scanning early."""
    n, inf = len(weights), float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)


def test_balanced_starts_are_the_exhaustive_dps_cuts():
    """tfbig-train's partitions are unchanged by the early stop (ties included: equal blocks,
    ALBERT's zero-parameter layers)."""
    import random

    rng = random.Random(0)
    cases = [[1.0] * 10, [0, 0, 5, 0, 0, 5, 0], [4.0] + [11.0] * 96 + [3.7]]
    cases += [[rng.choice([0, 1, 2, 3, 7]) for _ in range(rng.randint(2, 14))]
              for _ in range(60)]
    for weights in cases:
        for k in range(1, len(weights) + 1):
            assert balanced_starts(weights, k) == exhaustive_dp_starts(weights, k), (weights, k)


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


class _Task:
    model_config, seq_length = CONFIG, 16


def test_printed_memory_is_the_planners():
    """The plan tfbig-train prints holds tfbig-plan's bytes per stage: GPipe keeps all M
    micro-batches on every stage, 1F1B min(K - k, M); checkpointing keeps stage inputs."""
    plan = partition(layer_specs(CONFIG, 16), 4)
    table = {schedule: stage_memory(_Task(), plan, PipelineConfig(
        pipeline_stages=4, num_microbatches=8, schedule=schedule), 64)
        for schedule in ("gpipe", "1f1b")}
    recompute = stage_memory(_Task(), plan, PipelineConfig(
        pipeline_stages=4, num_microbatches=8, activation_checkpointing=True), 64)
    assert table["gpipe"][0]["state"] == 16 * plan[0].params  # weights, gradients, 2 slots
    assert table["gpipe"][0]["activations"] > 1.8 * table["1f1b"][0]["activations"]  # 8 vs 4
    assert recompute[0]["activations"] < table["1f1b"][0]["activations"]


def test_format_plan_lists_layers_params_and_memory():
    plan = partition(layer_specs(CONFIG, 16), 2)
    memory = stage_memory(_Task(), plan, PipelineConfig(pipeline_stages=2, num_microbatches=4),
                          64)
    text = format_plan(plan, ["/device:CPU:0", "/device:CPU:1"], memory)
    lines = text.splitlines()
    assert len(lines) == 3 and "est. memory" in lines[0]
    assert "/device:CPU:1" in lines[2] and plan[1].layer_names[-1] in lines[2]
    assert "embedding" in lines[1] and "B = " in lines[1]
