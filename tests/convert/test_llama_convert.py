"""Llama-family conversion against keras-hub, both directions, at odd sizes (hidden 48, 3
layers, 6 query / 2 key-value heads, intermediate 100, vocabulary 97), fp32, logits within 1e-5:

- keras-hub Llama (Llama 3 RoPE scaling), Mistral, Qwen 2 (biases, tied) and Qwen 3 (QK-norm)
  backbones -> tfbig Llama, from the object and through `tfbig-convert` on a saved preset;
- a Hugging Face directory (single file and sharded with model.safetensors.index.json, float32
  and bf16) written here from keras-hub's weights the way keras-hub's own HF converter reads
  them -> tfbig;
- tfbig's export (`tfbig-convert --to=huggingface`) -> keras-hub's Hugging Face reader
  (`LlamaBackbone.from_preset(local_dir)`, `QwenBackbone`) with equal logits;
- refusals by name (field and value, tensor and both shapes) that write nothing.
"""
import json
import os

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

from tfbig.commands.convert import ConvertOptions, convert  # noqa: E402
from tfbig.convert import llama, run_dir
from tfbig.errors import UsageError  # noqa: E402
from tfbig.convert.run_dir import load_model  # noqa: E402
from tfbig.models.llama import Llama  # noqa: E402

from random_backbones import logits, randomize  # noqa: E402

SIZES = dict(vocabulary_size=97, num_layers=3, num_query_heads=6, num_key_value_heads=2,
             hidden_dim=48, intermediate_dim=100, dtype="float32")
FAMILIES = {
    "llama": (keras_hub.models.LlamaBackbone, dict(
        rope_max_wavelength=500000.0, rope_frequency_adjustment_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
        rope_pretraining_sequence_length=32)),
    "mistral": (keras_hub.models.MistralBackbone, dict(sliding_window=None)),
    "qwen": (keras_hub.models.QwenBackbone, dict(tie_word_embeddings=True)),
    # keras-hub's Qwen3 normalises q/k with epsilon 1e-5 whatever layer_norm_epsilon says
    "qwen3": (keras_hub.models.Qwen3Backbone, dict(head_dim=10, tie_word_embeddings=False,
                                                   layer_norm_epsilon=1e-5)),
}
TOKENS = np.random.default_rng(0).integers(0, 97, size=(2, 13)).astype("int32")


def make_backbone(family, seed=0, **overrides):
    """A random keras-hub backbone; weights std 0.05, RMSNorm scales 1 +- 0.3 (a swapped or
    missing norm shows in the logits)."""
    cls, extra = FAMILIES[family]
    keras.utils.set_random_seed(seed)
    return randomize(cls(**SIZES, **{**extra, **overrides}), seed, std=0.05)


def keras_hub_logits(backbone, tokens=TOKENS):
    return logits(backbone, tokens)


@pytest.fixture(scope="module")
def backbones():
    return {family: make_backbone(family, seed=i) for i, family in enumerate(FAMILIES)}


def tfbig_model(config, weights):
    model = Llama(config, name="llama")
    model.build((None, None))
    run_dir.assign(model, weights)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_keras_hub_backbone_logits_equal_tfbig(backbones, family):
    config, weights = llama.from_keras_hub(backbones[family])
    assert (config.num_kv_heads, config.num_layers) == (2, 3)
    assert config.attention_bias == (family == "qwen") and config.qk_norm == (family == "qwen3")
    ours = tfbig_model(config, weights)(TOKENS).numpy()
    theirs = keras_hub_logits(backbones[family])
    assert np.abs(theirs).max() > 0.3  # logits big enough for 1e-5 to mean something
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,reader", [("llama", "LlamaBackbone"),
                                           ("mistral", "LlamaBackbone"),
                                           ("qwen", "QwenBackbone"),
                                           ("qwen3", "Qwen3Backbone")])
def test_preset_to_run_to_huggingface_read_by_keras_hub(backbones, family, reader, tmp_path):
    preset, run, hf = tmp_path / "preset", tmp_path / "run", tmp_path / "hf"
    backbones[family].save_to_preset(str(preset))
    convert(ConvertOptions(source=str(preset), output_dir=str(run)))
    model, _ = load_model(str(run))
    theirs = keras_hub_logits(backbones[family])
    np.testing.assert_allclose(model(TOKENS).numpy(), theirs, atol=1e-5, rtol=0)

    convert(ConvertOptions(source=str(run), output_dir=str(hf), to="huggingface"))
    raw = json.loads((hf / "config.json").read_text())
    assert raw["model_type"] == {"qwen": "qwen2", "qwen3": "qwen3"}.get(family, "llama")
    loaded = getattr(keras_hub.models, reader).from_preset(str(hf), dtype="float32")
    np.testing.assert_allclose(keras_hub_logits(loaded), model(TOKENS).numpy(), atol=1e-5,
                               rtol=0)


def test_tfbig_export_format_hf_writes_what_the_converter_writes(backbones, tmp_path):
    """`tfbig-export --format=hf` (the command, as a user runs it) writes the Hugging Face
    directory `tfbig-convert --to=huggingface` writes, byte for byte; an existing
    --export_dir is refused and left as it was."""
    from test_cli import command

    preset, run = tmp_path / "preset", tmp_path / "run"
    backbones["qwen"].save_to_preset(str(preset))
    convert(ConvertOptions(source=str(preset), output_dir=str(run)))
    convert(ConvertOptions(source=str(run), output_dir=str(tmp_path / "converted"),
                           to="huggingface"))
    code, out, err = command("tfbig-export", f"--model_dir={run}",
                             f"--export_dir={tmp_path / 'exported'}", "--format=hf")
    assert code == 0, err
    assert out.strip().endswith("model.safetensors")
    written = sorted(os.listdir(tmp_path / "converted"))
    assert sorted(os.listdir(tmp_path / "exported")) == written and "config.json" in written
    for name in written:
        assert (tmp_path / "exported" / name).read_bytes() == \
            (tmp_path / "converted" / name).read_bytes(), name
    code, _, err = command("tfbig-export", f"--model_dir={run}",
                           f"--export_dir={tmp_path / 'converted'}", "--format=hf")
    assert code != 0 and f"--export_dir={tmp_path / 'converted'} exists" in err, err
    assert sorted(os.listdir(tmp_path / "converted")) == written


def hf_tensors(backbone):
    """{Hugging Face name: array} of a keras-hub backbone, as keras-hub's HF converter
    (convert_llama3 / convert_qwen / convert_mistral) reads them: Linear weights (out, in)."""
    c = backbone.hidden_dim
    weights = {w.path: np.asarray(w.numpy()) for w in backbone.weights}
    out = {"model.embed_tokens.weight": weights["token_embedding/embeddings"],
           "model.norm.weight": weights["sequence_output_layernorm/scale"]}
    if "token_embedding/reverse_embeddings" in weights:
        out["lm_head.weight"] = weights["token_embedding/reverse_embeddings"].T
    for i in range(backbone.num_layers):
        p, k = f"model.layers.{i}.", f"transformer_layer_{i}/"
        out[p + "input_layernorm.weight"] = weights[k + "self_attention_layernorm/scale"]
        out[p + "post_attention_layernorm.weight"] = weights[k + "feedforward_layernorm/scale"]
        for hf_name, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            out[f"{p}self_attn.{hf_name}.weight"] = \
                weights[f"{k}self_attention/{ours}/kernel"].reshape(c, -1).T
            if f"{k}self_attention/{ours}/bias" in weights:
                out[f"{p}self_attn.{hf_name}.bias"] = \
                    weights[f"{k}self_attention/{ours}/bias"].reshape(-1)
        out[p + "self_attn.o_proj.weight"] = \
            weights[k + "self_attention/attention_output/kernel"].reshape(-1, c).T
        for hf_name, ours in (("gate_proj", "feedforward_gate_dense"),
                              ("up_proj", "feedforward_intermediate_dense"),
                              ("down_proj", "feedforward_output_dense")):
            out[f"{p}mlp.{hf_name}.weight"] = weights[f"{k}{ours}/kernel"].T
    return {name: np.ascontiguousarray(v) for name, v in out.items()}


def hf_config(family, backbone, **overrides):
    config = {"model_type": {"qwen": "qwen2"}.get(family, family),
              "vocab_size": 97, "hidden_size": 48, "intermediate_size": 100,
              "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
              "hidden_act": "silu", "max_position_embeddings": 64,
              "rms_norm_eps": backbone.layer_norm_epsilon,
              "rope_theta": float(backbone.rope_max_wavelength),
              "tie_word_embeddings": bool(getattr(backbone, "tie_word_embeddings", False))}
    if family == "llama":
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}
    if family in ("mistral", "qwen"):
        config.update(sliding_window=None, use_sliding_window=False)
    return {**config, **overrides}


def write_hf(directory, config, tensors, shards=1, dtype=None):
    """A Hugging Face directory: config.json + model.safetensors, or `shards` files and
    model.safetensors.index.json as transformers' save_pretrained writes them."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if dtype is not None:
        tensors = {n: v.astype(dtype) for n, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("family,shards", [("llama", 1), ("mistral", 3), ("qwen", 2)])
def test_huggingface_directory_in_single_and_sharded(backbones, family, shards, tmp_path):
    backbone = backbones[family]
    source, run = tmp_path / "hf", tmp_path / "run"
    write_hf(source, hf_config(family, backbone), hf_tensors(backbone), shards)
    convert(ConvertOptions(source=str(source), output_dir=str(run)))
    model, _ = load_model(str(run))
    assert json.loads((run / "config.json").read_text())["converted_from"].startswith("hugg")
    np.testing.assert_allclose(model(TOKENS).numpy(), keras_hub_logits(backbone), atol=1e-5,
                               rtol=0)


def test_bf16_checkpoint_is_read_as_float32(backbones, tmp_path):
    import ml_dtypes

    tensors = hf_tensors(backbones["llama"])
    write_hf(tmp_path / "hf", hf_config("llama", backbones["llama"]), tensors,
             dtype=ml_dtypes.bfloat16)
    config, weights, _, _ = llama.read_huggingface(str(tmp_path / "hf"))
    key = "block_1/attn/key/kernel"
    expected = tensors["model.layers.1.self_attn.k_proj.weight"].T
    assert weights[key].dtype == np.float32
    np.testing.assert_allclose(weights[key], expected, rtol=1e-2, atol=1e-3)  # bf16 rounding
    assert not np.array_equal(weights[key], expected)  # it went through bf16

    # --init_checkpoint reads it in place: the bf16 bytes mapped, a tensor rank's columns cut
    # from the map and widened to float32 when assigned (tfbig.convert.init_checkpoint.load)
    import types

    import tensorflow as tf

    from tfbig.convert import init_checkpoint
    from tfbig.layouts.tensor_layout import take_slice

    _, shapes, read = llama.huggingface_weight_reader(str(tmp_path / "hf"))
    assert read(key).dtype == ml_dtypes.bfloat16 and isinstance(read(key).base, np.memmap)
    half = weights[key][:, weights[key].shape[1] // 2:]
    holder = tf.Variable(tf.zeros(half.shape))
    pieces = {k: [None, None, shape] for k, shape in shapes.items()}
    pieces[key] = [holder, lambda w: take_slice(w, -1, 1, 1, 2), shapes[key]]
    init_checkpoint.load(types.SimpleNamespace(name="llama"), str(tmp_path / "hf"), pieces)
    np.testing.assert_array_equal(holder.numpy(), half)


def test_sharded_export_is_read_by_keras_hub_and_tfbig(backbones, tmp_path):
    config, weights = llama.from_keras_hub(backbones["llama"])
    path = llama.write_huggingface(str(tmp_path / "hf"), config, weights,
                                   max_shard_bytes=40_000)
    assert path.endswith("model.safetensors.index.json")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = keras_hub.models.LlamaBackbone.from_preset(str(tmp_path / "hf"), dtype="float32")
    theirs = keras_hub_logits(backbones["llama"])
    np.testing.assert_allclose(keras_hub_logits(loaded), theirs, atol=1e-5, rtol=0)
    again, back, _, _ = llama.read_huggingface(str(tmp_path / "hf"))
    assert again == config
    for key, value in weights.items():
        np.testing.assert_array_equal(back[key], value)


@pytest.mark.parametrize("change,message", [
    (dict(model_type="mistral", sliding_window=16, use_sliding_window=True),
     "sliding_window=16 with max_position_embeddings=64"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type='yarn'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(model_type="gemma"), "model_type='gemma'"),
])
def test_unsupported_config_is_refused_by_name_and_nothing_written(backbones, change, message,
                                                                    tmp_path):
    source, run = tmp_path / "hf", tmp_path / "run"
    backbone = backbones["llama"]
    write_hf(source, hf_config("llama", backbone, **change), hf_tensors(backbone))
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")):
        if change.get("model_type") == "gemma":  # not this family: the direct reader refuses
            llama.read_huggingface(str(source))
        else:
            convert(ConvertOptions(source=str(source), output_dir=str(run)))
    assert not run.exists()


def test_shape_mismatch_names_the_tensor_and_both_shapes(backbones, tmp_path):
    source, run = tmp_path / "hf", tmp_path / "run"
    tensors = hf_tensors(backbones["llama"])
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((24, 48), np.float32)
    write_hf(source, hf_config("llama", backbones["llama"]), tensors)
    with pytest.raises(UsageError, match=r"model.layers.1.self_attn.k_proj.weight has shape "
                                         r"\(24, 48\) .* implies \(16, 48\)"):
        convert(ConvertOptions(source=str(source), output_dir=str(run)))
    assert not run.exists()


def test_keras_hub_sliding_window_is_refused(tmp_path):
    preset, run = tmp_path / "preset", tmp_path / "run"
    make_backbone("mistral", sliding_window=16).save_to_preset(str(preset))
    with pytest.raises(UsageError, match="sliding_window=16"):
        convert(ConvertOptions(source=str(preset), output_dir=str(run)))
    assert not run.exists()


def test_export_refuses_a_non_empty_output_and_writes_nothing_more(backbones, tmp_path):
    config, weights = llama.from_keras_hub(backbones["qwen"])
    llama.write_huggingface(str(tmp_path / "hf"), config, weights)
    before = sorted(os.listdir(tmp_path / "hf"))
    with pytest.raises(UsageError, match="already holds a config.json"):
        llama.write_huggingface(str(tmp_path / "hf"), config, weights, max_shard_bytes=1000)
    assert sorted(os.listdir(tmp_path / "hf")) == before


def test_a_backbone_of_another_family_is_refused_by_its_registered_name():
    other = keras_hub.models.GPT2Backbone(vocabulary_size=11, num_layers=1, num_heads=2,
                                          hidden_dim=8, intermediate_dim=16,
                                          max_sequence_length=8)
    with pytest.raises(UsageError, match="a keras_hub>GPT2Backbone; the Llama family reads"):
        llama.from_keras_hub(other)
