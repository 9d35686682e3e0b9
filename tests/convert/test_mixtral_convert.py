"""Mixtral checkpoints in and out of tfbig's MoE Llama (tfbig.convert.moe_names beside
tfbig.convert.llama_names): a random tiny keras-hub MixtralBackbone saved as a local preset
converts into a tfbig run with keras-hub's logits (within 1e-5, float32); the run exports as a
Hugging Face MixtralForCausalLM directory (per-expert w1/w3/w2 safetensors names, config.json
with num_local_experts) that keras-hub's own Hugging Face reader loads with the same logits;
a missing expert tensor is refused by name before anything is written."""
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


@pytest.fixture(scope="module")
def backbone():
    """Odd sizes (hidden 24, 3 query / 1 key-value heads, experts of width 40), weights std
    0.1, RMSNorm scales 1 +- 0.3: a swapped expert matrix or norm shows in the logits."""
    keras.utils.set_random_seed(0)
    model = keras_hub.models.MixtralBackbone(
        vocabulary_size=61, num_layers=2, num_query_heads=3, num_key_value_heads=1,
        hidden_dim=24, intermediate_dim=40, num_experts=4, top_k=2, sliding_window=None,
        layer_norm_epsilon=1e-5, dtype="float32")
    return randomize(model)


def keras_hub_logits(model):
    return logits(model, TOKENS)


def test_keras_hub_mixtral_to_tfbig_to_huggingface_and_back_keeps_the_logits(backbone,
                                                                             tmp_path):
    run, hf = tmp_path / "run", tmp_path / "hf"
    model = preset_to_tfbig(backbone, tmp_path)
    config = model.config
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size) == \
        (4, 2, 40)
    theirs = keras_hub_logits(backbone)
    assert np.abs(theirs).max() > 0.3  # logits big enough for 1e-5 to mean something
    np.testing.assert_allclose(model(TOKENS).numpy(), theirs, atol=1e-5, rtol=0)

    convert(ConvertOptions(source=str(run), output_dir=str(hf), to="huggingface"))
    raw = json.loads((hf / "config.json").read_text())
    assert raw["architectures"] == ["MixtralForCausalLM"] and raw["num_local_experts"] == 4
    from safetensors.numpy import load_file

    tensors = load_file(str(hf / "model.safetensors"))
    assert tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (24, 40)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 24)
    assert not any(".mlp." in name for name in tensors)
    loaded = keras_hub.models.MixtralBackbone.from_preset(str(hf), dtype="float32")
    np.testing.assert_allclose(keras_hub_logits(loaded), model(TOKENS).numpy(), atol=1e-5,
                               rtol=0)

    # Hugging Face in: the exported directory converts back into the same model
    convert(ConvertOptions(source=str(hf), output_dir=str(tmp_path / "back")))
    back, _ = load_model(str(tmp_path / "back"))
    np.testing.assert_allclose(back(TOKENS).numpy(), theirs, atol=1e-5, rtol=0)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    from safetensors.numpy import save_file

    save_file(tensors, str(hf / "model.safetensors"))
    with pytest.raises(UsageError, match=r"experts\.2\.w3\.weight"):
        convert(ConvertOptions(source=str(hf), output_dir=str(tmp_path / "again")))
    assert not os.path.exists(tmp_path / "again")
