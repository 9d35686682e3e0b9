"""Llama model: grouped-query attention against its multi-head expansion, RoPE (relative
positions, Llama 3 scaling against Hugging Face's formula), causality, blockwise = dense, exact
parameter formula and published sizes, config round trip, KV-cache generation."""
import dataclasses
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfbig.models.generation import Generator
from tfbig.models.llama import Llama, LlamaConfig, apply_rope, rope_frequencies


def tiny_config(**overrides):
    fields = dict(vocab_size=97, seq_length=32, num_layers=2, hidden_size=48, num_heads=6,
                  num_kv_heads=2, intermediate_size=100)
    return LlamaConfig(**{**fields, **overrides})


def build(config, seed=0):
    keras.utils.set_random_seed(seed)
    model = Llama(config, name="llama")
    model.build((None, None))
    return model


def ids(batch=2, length=13, seed=0):
    return np.random.default_rng(seed).integers(0, 97, size=(batch, length)).astype("int32")


def randomise_norms(model, seed=1):
    """RMSNorm scales away from 1 so that a wrong scale shows in the logits."""
    rng = np.random.default_rng(seed)
    for v in model.variables:
        if v.path.endswith("scale"):
            v.assign(1 + 0.3 * rng.standard_normal(v.shape).astype("float32"))


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_heads():
    gqa = build(tiny_config(qk_norm=True, attention_bias=True))
    randomise_norms(gqa)
    mha = build(tiny_config(qk_norm=True, attention_bias=True, num_kv_heads=6), seed=1)
    groups, hs = 3, 8
    for source, target in zip(gqa.variables, mha.variables):
        assert source.path == target.path
        value = source.numpy()
        if "/key/" in source.path or "/value/" in source.path:  # (C, kv*hs) or (kv*hs,)
            lead = value.shape[:-1]
            value = np.repeat(value.reshape(lead + (2, hs)), groups, axis=-2)
            value = value.reshape(lead + (6 * hs,))  # query head h reads kv head h // groups
        target.assign(value)
    np.testing.assert_allclose(gqa(ids()).numpy(), mha(ids()).numpy(), rtol=1e-5, atol=1e-5)


def test_changing_token_t_never_changes_earlier_logits():
    model = build(tiny_config())
    base_ids = ids(length=24)
    base = model(base_ids).numpy()
    for t in (0, 7, 23):
        changed = base_ids.copy()
        changed[:, t] = (changed[:, t] + 1) % 97
        out = model(changed).numpy()
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert np.abs(out[:, t:] - base[:, t:]).max() > 1e-6


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 1, 16)).astype("float32")
    k = rng.standard_normal((1, 1, 1, 16)).astype("float32")
    inverse = rope_frequencies(16, dict(rope_theta=10000.0, rope_scaling="none"))
    at = lambda p: np.array([p], np.float32)  # noqa: E731 - one row at position p
    scores = [float(np.sum(apply_rope(q, inverse, at(i + s)).numpy() *
                           apply_rope(k, inverse, at(s)).numpy())) for s in (0, 5, 17) for i in (3,)]
    np.testing.assert_allclose(scores, scores[0], rtol=1e-5)
    unrotated = float(np.sum(q * k))
    assert abs(scores[0] - unrotated) > 1e-3  # the rotation does something at distance 3


def test_llama3_rope_scaling_equals_hugging_face_formula():
    rope = dict(rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0,
                rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_seq_length=8192)
    ours = np.asarray(rope_frequencies(128, rope))
    # transformers' _compute_llama3_parameters, re-typed in numpy
    inv = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    scaled = np.where(wavelen > low_wavelen, inv / 8.0, inv)
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    smoothed = (1 - smooth) * scaled / 8.0 + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    expected = np.where(medium, smoothed, scaled)
    assert medium.sum() > 0 and (wavelen > low_wavelen).sum() > 0 and (
        wavelen < high_wavelen).sum() > 0  # all three bands are exercised
    np.testing.assert_allclose(ours, expected, rtol=2e-6)


def test_blockwise_attention_equals_dense_in_values_and_gradients():
    dense = build(tiny_config(attention="dense"))
    blockwise = build(tiny_config(attention="blockwise", attention_block_size=4))
    for a, b in zip(dense.variables, blockwise.variables):
        b.assign(a)
    x = ids(length=13)

    def loss_and_grads(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        return loss, tape.gradient(loss, model.trainable_variables)

    (l1, g1), (l2, g2) = loss_and_grads(dense), loss_and_grads(blockwise)
    np.testing.assert_allclose(l1.numpy(), l2.numpy(), rtol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(),
                                   tf.convert_to_tensor(b).numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("overrides", [{}, dict(tie_embeddings=True),
                                       dict(attention_bias=True), dict(qk_norm=True, head_size=10),
                                       dict(num_kv_heads=1)])
def test_closed_form_parameter_count_equals_built_model(overrides):
    config = tiny_config(**overrides)
    assert build(config).count_params() == config.num_params()


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_preset_parameter_count_equals_built_model(name):
    config = LlamaConfig.from_preset(name)
    assert build(config).count_params() == config.num_params()


@pytest.mark.parametrize("name,published", [("llama-1b", 1_235_814_400),
                                            ("llama-8b", 8_030_261_248),
                                            ("llama-70b", 70_553_706_496),
                                            ("llama-405b", 405_853_388_800)])
def test_published_presets_have_the_published_parameter_counts(name, published):
    # The formula is exact on built models (above); the published shapes are too big to build.
    assert abs(LlamaConfig.from_preset(name).num_params() / published - 1) < 1e-3


def test_config_round_trip_and_refusals():
    model = build(tiny_config(dropout=0.1, qk_norm=True))
    clone = Llama.from_config(model.get_config())
    assert clone.config == model.config
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by num_kv_heads=4"):
        tiny_config(num_kv_heads=4)
    with pytest.raises(ValueError, match="rope_scaling='yarn'"):
        tiny_config(rope_scaling="yarn")
    with pytest.raises(ValueError, match="head_size=7 is odd"):
        tiny_config(head_size=7)


def test_cache_holds_key_value_heads_only():
    config = tiny_config()
    cache = build(config).init_cache(3, 20)
    assert tuple(cache.shape) == (2, 2, 3, 20, 2, 8)  # (L, k|v, B, S, kv heads, hs)


@pytest.mark.parametrize("overrides", [
    dict(qk_norm=True, rope_scaling="llama3", rope_original_seq_length=16),
    pytest.param(dict(attention="blockwise", attention_block_size=4), marks=pytest.mark.slow)])
def test_cached_greedy_generation_equals_full_recomputation(overrides):
    model = build(tiny_config(**overrides))
    randomise_norms(model)
    generator = Generator(model)
    prompt = ids(batch=2, length=5)
    cached = generator(prompt, 8, temperature=0.0, use_cache=True)
    full = generator(prompt, 8, temperature=0.0, use_cache=False)
    np.testing.assert_array_equal(cached, full)
    assert len(set(cached[0, 5:].tolist())) > 1  # not one token repeated


def test_logits_are_float32_under_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = build(tiny_config())
    assert model(ids()).dtype == tf.float32
    assert model.init_cache(1, 4).dtype == tf.bfloat16


def test_config_fields_each_have_a_one_line_doc():
    import inspect

    source = inspect.getsource(LlamaConfig)
    for f in dataclasses.fields(LlamaConfig):
        line = next(line for line in source.splitlines() if line.strip().startswith(f"{f.name}:"))
        assert "#" in line, f.name


@pytest.mark.parametrize("tied", [False, True])
def test_the_declared_layout_names_layers_the_model_has(tied):
    """Llama.layout() (tfbig.models.layout): activation checkpointing finds the blocks; ZeRO-3
    gathers every weight in exactly one place (a tied table per step); every tensor and context
    entry names layers this model has (head: only an untied one; the query/key norms: only
    Qwen 3's, built here with the tied table)."""
    from tfbig.distribute import recompute, zero3
    from tfbig.layouts.tensor_plan import resolve_plan_layers

    model = build(tiny_config(tie_embeddings=tied, qk_norm=tied))
    layout = model.layout()
    assert recompute.transformer_blocks(model) == model.blocks
    per_call, per_step = zero3.plan_layers(model)
    assert len(per_call) == len(model.blocks) + (1 if tied else 3)  # final_norm [head, table]
    assert [v.path for v in per_step] == ([model.embedding.embeddings.path] if tied else [])
    for path, _ in layout.tensor + layout.context:
        assert resolve_plan_layers(model, path) or (path == "head" and tied) or (
            path.endswith("_norm") and ".attn." in path and not tied), path
    assert layout.local_loss
