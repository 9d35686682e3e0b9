"""Qwen2-MoE checkpoints in and out of tfbig's MoE Llama (tfbig.convert.moe_names): a random tiny
keras-hub QwenMoeBackbone (q/k/v biases, experts whose gate and up share one stacked weight, and
a shared expert scaled per token by the sigmoid of its gate) saved as a local preset converts
into a tfbig run with keras-hub's logits (within 1e-5, float32), for both routers; the run
exports as a Hugging Face Qwen2MoeForCausalLM directory (mlp.shared_expert.* and
mlp.shared_expert_gate safetensors names) that keras-hub's own Hugging Face reader loads with
the same logits and tfbig-convert reads back; what the family cannot hold is refused by name."""
import json
import os

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

from tfbig.commands.convert import ConvertOptions, convert  # noqa: E402
from tfbig.convert.run_dir import load_model  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402

from random_backbones import logits, preset_to_tfbig, randomize  # noqa: E402

TOKENS = np.random.default_rng(1).integers(0, 61, size=(2, 11)).astype("int32")


def backbone(norm_top_k_prob, **options):
    """Odd sizes (hidden 24, 4 query / 2 key-value heads, experts of width 20, a shared expert
    of 28), weights std 0.1, RMSNorm scales 1 +- 0.3: a swapped expert half, a missing bias or
    an ungated shared expert shows in the logits."""
    keras.utils.set_random_seed(0)
    model = keras_hub.models.QwenMoeBackbone(
        vocabulary_size=61, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=24, intermediate_dim=40, moe_intermediate_dim=20,
        shared_expert_intermediate_dim=28, num_experts=4, top_k=2,
        norm_top_k_prob=norm_top_k_prob, layer_norm_epsilon=1e-6, dtype="float32", **options)
    return randomize(model)


@pytest.mark.parametrize("norm_top_k_prob, router", [
    (True, "after_topk"),
    pytest.param(False, "before_topk", marks=pytest.mark.slow)])  # Qwen3-MoE's test has both
def test_keras_hub_qwen2_moe_to_tfbig_to_huggingface_and_back_keeps_the_logits(
        norm_top_k_prob, router, tmp_path):
    theirs_model = backbone(norm_top_k_prob)
    run, hf = tmp_path / "run", tmp_path / "hf"
    model = preset_to_tfbig(theirs_model, tmp_path)
    config = model.config
    assert (config.num_experts, config.moe_intermediate_size, config.shared_intermediate_size,
            config.shared_expert_gate, config.router_softmax, config.attention_bias) == (
        4, 20, 28, True, router, True)
    theirs = logits(theirs_model, TOKENS)
    assert np.abs(theirs).max() > 0.3  # logits big enough for 1e-5 to mean something
    np.testing.assert_allclose(model(TOKENS).numpy(), theirs, atol=1e-5, rtol=0)

    convert(ConvertOptions(source=str(run), output_dir=str(hf), to="huggingface"))
    raw = json.loads((hf / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2MoeForCausalLM"] and raw["model_type"] == "qwen2_moe"
    assert (raw["shared_expert_intermediate_size"], raw["norm_topk_prob"]) == (28,
                                                                               norm_top_k_prob)
    from safetensors.numpy import load_file

    tensors = load_file(str(hf / "model.safetensors"))
    assert tensors["model.layers.1.mlp.shared_expert.down_proj.weight"].shape == (24, 28)
    assert tensors["model.layers.1.mlp.shared_expert.gate_proj.weight"].shape == (28, 24)
    assert tensors["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 24)
    assert tensors["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (20, 24)
    assert tensors["model.layers.0.self_attn.k_proj.bias"].shape == (12,)
    loaded = keras_hub.models.QwenMoeBackbone.from_preset(str(hf), dtype="float32")
    np.testing.assert_allclose(logits(loaded, TOKENS), model(TOKENS).numpy(), atol=1e-5,
                               rtol=0)

    # Hugging Face in: the exported directory converts back into the same model
    convert(ConvertOptions(source=str(hf), output_dir=str(tmp_path / "back")))
    back, _ = load_model(str(tmp_path / "back"))
    np.testing.assert_allclose(back(TOKENS).numpy(), theirs, atol=1e-5, rtol=0)


def test_the_shared_expert_gate_is_applied_per_token():
    """tfbig's layer alone: y = routed experts + sigmoid(x . w) * shared(x), w the gate's kernel
    (a zero gate halves the shared expert's part; the routed part is unchanged)."""
    from tfbig.models.moe import SparseMoE

    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    moe = SparseMoE(8, 12, 4, 2, shared_intermediate_size=6, shared_gate=True,
                    initializer_range=0.3)
    y, _ = moe(x)
    tokens = x.reshape(-1, 8)
    shared = moe.shared(tokens, np.array([10], "int32")).numpy()
    gate = 1 / (1 + np.exp(-tokens @ moe.shared_gate.kernel.numpy()))
    routed = y.numpy().reshape(-1, 8) - gate * shared
    moe.shared_gate.kernel.assign(np.zeros((8, 1), "float32"))
    y0, _ = moe(x)
    np.testing.assert_allclose(y0.numpy().reshape(-1, 8), routed + 0.5 * shared, atol=1e-6)
    assert np.abs(gate - 0.5).max() > 0.05  # the drawn gate was not already 1/2


def test_what_qwen2_moe_cannot_hold_is_refused_by_name(tmp_path):
    """A gate without shared experts; an export without q/k/v biases or with a head_size other
    than hidden / heads; a Hugging Face directory missing the shared expert's gate: named,
    nothing written."""
    from tfbig.convert import llama_names
    from tfbig.models.llama_config import LlamaConfig

    tiny = dict(vocab_size=61, seq_length=16, num_layers=1, hidden_size=24, num_heads=4,
                num_kv_heads=2, num_experts=4, experts_per_token=2, moe_intermediate_size=20)
    with pytest.raises(ValueError, match="--shared_expert_gate scales the shared experts' "
                                         "output: set --shared_intermediate_size above 0"):
        LlamaConfig(**tiny, shared_expert_gate=True)
    gated = dict(tiny, shared_intermediate_size=28, shared_expert_gate=True)
    with pytest.raises(UsageError, match="attention_bias=False: a qwen2_moe checkpoint has "
                                         "attention_bias=True"):
        llama_names.hf_config(LlamaConfig(**gated))
    with pytest.raises(UsageError, match="head_size=8: a qwen2_moe checkpoint has head_size=6"):
        llama_names.hf_config(LlamaConfig(**gated, attention_bias=True, head_size=8))

    run, hf = tmp_path / "run", tmp_path / "hf"
    preset_to_tfbig(backbone(True), tmp_path)
    convert(ConvertOptions(source=str(run), output_dir=str(hf), to="huggingface"))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["model.layers.1.mlp.shared_expert_gate.weight"]
    save_file(tensors, str(hf / "model.safetensors"))
    with pytest.raises(UsageError, match=r"mlp\.shared_expert_gate\.weight"):
        convert(ConvertOptions(source=str(hf), output_dir=str(tmp_path / "again")))
    assert not os.path.exists(tmp_path / "again")
