"""The planner's MoE Llama: Mixtral 8x7B's published sizes (46.7B parameters, 12.9B active per
token), FLOPs from the active parameters only, and the model state per rank under
--expert_parallel: the routed experts' weights, gradients and Adam state divided by the expert
group, the rest whole."""
import pytest

from tfbig.models import shapes as models
from tfbig.models.llama import LlamaConfig
from tfbig.plan import estimate

from .memory_probe import CPU


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
