"""Qwen3-MoE checkpoints in and out of tfbig's MoE Llama (tfbig.convert.moe_names): a random tiny
keras-hub Qwen3MoeBackbone (QK-norm, experts whose gate and up share one stacked weight) saved
as a local preset converts into a tfbig run with keras-hub's logits (within 1e-5, float32), for
both routers (norm_top_k_prob true: tfbig's after_topk; false: before_topk); the run exports as
a Hugging Face Qwen3MoeForCausalLM directory (mlp.gate and mlp.experts.j.gate_proj/up_proj/
down_proj safetensors names) that keras-hub's own Hugging Face reader loads with the same
logits and tfbig-convert reads back; what tfbig's MoE Llama cannot hold is refused by name
before anything is written."""
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

TOKENS = np.random.default_rng(0).integers(0, 61, size=(2, 11)).astype("int32")


def backbone(norm_top_k_prob, **options):
    """Odd sizes (hidden 24, 3 query / 1 key-value heads of 10, experts of width 20), weights
    std 0.1, RMSNorm scales 1 +- 0.3: a swapped expert half, norm or router shows in the
    logits."""
    keras.utils.set_random_seed(0)
    model = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=61, num_layers=2, num_query_heads=3, num_key_value_heads=1,
        head_dim=10, hidden_dim=24, intermediate_dim=40, moe_intermediate_dim=20,
        num_experts=4, top_k=2, norm_top_k_prob=norm_top_k_prob, sliding_window_size=None,
        layer_norm_epsilon=1e-6, dtype="float32", **options)
    return randomize(model)


def keras_hub_logits(model):
    return logits(model, TOKENS)


@pytest.mark.parametrize("norm_top_k_prob, router", [(True, "after_topk"),
                                                     (False, "before_topk")])
def test_keras_hub_qwen3_moe_to_tfbig_to_huggingface_and_back_keeps_the_logits(
        norm_top_k_prob, router, tmp_path):
    theirs_model = backbone(norm_top_k_prob)
    run, hf = tmp_path / "run", tmp_path / "hf"
    model = preset_to_tfbig(theirs_model, tmp_path)
    config = model.config
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size,
            config.router_softmax, config.qk_norm) == (4, 2, 20, router, True)
    theirs = keras_hub_logits(theirs_model)
    assert np.abs(theirs).max() > 0.3  # logits big enough for 1e-5 to mean something
    np.testing.assert_allclose(model(TOKENS).numpy(), theirs, atol=1e-5, rtol=0)

    convert(ConvertOptions(source=str(run), output_dir=str(hf), to="huggingface"))
    raw = json.loads((hf / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"] and raw["num_experts"] == 4
    assert raw["norm_topk_prob"] is norm_top_k_prob and raw["moe_intermediate_size"] == 20
    from safetensors.numpy import load_file

    tensors = load_file(str(hf / "model.safetensors"))
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (24, 20)
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (20, 24)
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (4, 24)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (10,)
    assert not any("block_sparse_moe" in name for name in tensors)
    loaded = keras_hub.models.Qwen3MoeBackbone.from_preset(str(hf), dtype="float32")
    np.testing.assert_allclose(keras_hub_logits(loaded), model(TOKENS).numpy(), atol=1e-5,
                               rtol=0)

    # Hugging Face in: the exported directory converts back into the same model
    convert(ConvertOptions(source=str(hf), output_dir=str(tmp_path / "back")))
    back, _ = load_model(str(tmp_path / "back"))
    np.testing.assert_allclose(back(TOKENS).numpy(), theirs, atol=1e-5, rtol=0)


def test_what_the_moe_llama_cannot_hold_is_refused_by_name(tmp_path):
    """A dense block among the MoE ones (keras-hub's mlp_only_layers, Hugging Face's
    decoder_sparse_step) and a missing expert tensor: named, nothing written."""
    preset = tmp_path / "preset"
    backbone(True, mlp_only_layers=[1]).save_to_preset(str(preset))
    with pytest.raises(UsageError, match=r"mlp_only_layers=\[1\]; tfbig's MoE Llama has an "
                                         r"MoE MLP in every block"):
        convert(ConvertOptions(source=str(preset), output_dir=str(tmp_path / "out")))
    assert not os.path.exists(tmp_path / "out")

    run, hf = tmp_path / "run", tmp_path / "hf"
    backbone(True).save_to_preset(str(tmp_path / "sparse"))
    convert(ConvertOptions(source=str(tmp_path / "sparse"), output_dir=str(run)))
    convert(ConvertOptions(source=str(run), output_dir=str(hf), to="huggingface"))
    raw = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**raw, "decoder_sparse_step": 2}))
    with pytest.raises(UsageError, match="decoder_sparse_step=2"):
        convert(ConvertOptions(source=str(hf), output_dir=str(tmp_path / "again")))
    (hf / "config.json").write_text(json.dumps(raw))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(hf / "model.safetensors"))
    with pytest.raises(UsageError, match=r"experts\.2\.up_proj\.weight"):
        convert(ConvertOptions(source=str(hf), output_dir=str(tmp_path / "again")))
    assert not os.path.exists(tmp_path / "again")


def test_an_moe_llama_exports_as_the_family_that_holds_it():
    """QK-norm: Qwen3-MoE; without: Mixtral; shared experts (neither has them) or Mixtral with
    the before_topk router: refused by name."""
    from tfbig.convert import llama_names
    from tfbig.models.llama_config import LlamaConfig

    tiny = dict(vocab_size=61, seq_length=16, num_layers=1, hidden_size=24, num_heads=3,
                num_kv_heads=1, num_experts=4, experts_per_token=2, moe_intermediate_size=20)
    assert llama_names.hf_config(LlamaConfig(**tiny, qk_norm=True))["architectures"] == [
        "Qwen3MoeForCausalLM"]
    assert llama_names.hf_config(LlamaConfig(**tiny))["architectures"] == [
        "MixtralForCausalLM"]
    with pytest.raises(UsageError, match="shared_intermediate_size=8: a qwen3_moe checkpoint "
                                         "has shared_intermediate_size=0"):
        llama_names.hf_config(LlamaConfig(**tiny, qk_norm=True, shared_intermediate_size=8))
    with pytest.raises(UsageError, match="router_softmax='before_topk': a mixtral checkpoint"):
        llama_names.hf_config(LlamaConfig(**tiny, router_softmax="before_topk"))
