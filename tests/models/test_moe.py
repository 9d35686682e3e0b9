"""Sparse MoE MLP (tfbig.models.moe): routing statistics (load-balancing loss, z-loss, tokens
per expert, dropped tokens under a capacity) against a NumPy reference written from the
papers' formulas on a fixed batch; the dropless layer against a dense loop over every expert
(outputs and gradients); the MoE Llama's parameter formula and routing outputs."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfbig.models.llama import Llama, LlamaConfig
from tfbig.models.moe import SparseMoE, route


def numpy_route(logits, k, softmax, capacity_factor=0.0):
    """Routing by loops: top-k per token, weights, per-expert counts, Switch aux loss,
    z-loss, and GShard's capacity (first choices of every token before second choices)."""
    n, e = logits.shape
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # (N, k)
    if softmax == "after_topk":
        top = np.take_along_axis(logits, experts, -1)
        weights = np.exp(top - top.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
    else:
        weights = np.take_along_axis(probs, experts, -1)
    counts = np.zeros(e)
    for token in range(n):
        for slot in range(k):
            counts[experts[token, slot]] += 1
    kept = np.ones((n, k), bool)
    if capacity_factor:
        capacity, taken = np.ceil(capacity_factor * n * k / e), np.zeros(e)
        for slot in range(k):
            for token in range(n):
                expert = experts[token, slot]
                kept[token, slot] = taken[expert] < capacity
                taken[expert] += 1
    aux = e * np.sum(counts / (n * k) * probs.mean(0))
    logsumexp = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return dict(experts=experts, weights=np.where(kept, weights, 0.0), counts=counts,
                aux=aux, z=np.mean(logsumexp ** 2), dropped=np.sum(~kept))


def fixed_logits(n=40, e=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, e)) * 2 + np.array([1.5, 0.0, -0.5, 0.2])[:e]).astype(
        "float32")  # a skewed router: expert 0 over-subscribed


def test_token_sums_make_a_part_of_the_batch_route_with_the_whole_batchs_statistics():
    """Context parallelism's hook (SparseMoE.token_sums): a call seeing half the tokens, given
    the other half's counts, probability sums and token count, has the whole batch's
    load-balancing loss and counts, where its own half's alone differ."""
    logits = tf.constant(fixed_logits())
    half = logits.shape[0] // 2
    whole = route(logits, 2, "after_topk")
    other = route(logits[half:], 2, "after_topk")
    other_sums = (other["tokens_per_expert"], tf.reduce_sum(tf.nn.softmax(logits[half:]), 0),
                  tf.constant(float(logits.shape[0] - half)))
    joined = route(logits[:half], 2, "after_topk",
                   token_sums=lambda *mine: [a + b for a, b in zip(mine, other_sums)])
    np.testing.assert_allclose(joined["aux_loss"], whole["aux_loss"], rtol=1e-6)
    np.testing.assert_array_equal(joined["tokens_per_expert"], whole["tokens_per_expert"])
    alone = route(logits[:half], 2, "after_topk")
    assert abs(float(alone["aux_loss"]) - float(whole["aux_loss"])) > 1e-3


@pytest.mark.parametrize("k,softmax", [(1, "after_topk"), (2, "after_topk"),
                                       (2, "before_topk")])
def test_routing_statistics_equal_the_numpy_reference(k, softmax):
    logits = fixed_logits()
    ours = {key: np.asarray(v) for key, v in route(tf.constant(logits), k, softmax).items()}
    ref = numpy_route(logits, k, softmax)
    np.testing.assert_array_equal(ours["experts"].T, ref["experts"])
    np.testing.assert_allclose(ours["weights"].T, ref["weights"], rtol=1e-6)
    np.testing.assert_array_equal(ours["tokens_per_expert"], ref["counts"])
    assert ref["counts"].max() > ref["counts"].min() + 5  # imbalanced: the aux loss is not 1
    np.testing.assert_allclose(ours["aux_loss"], ref["aux"], rtol=1e-6)
    assert ref["aux"] > 1.05
    np.testing.assert_allclose(ours["z_loss"], ref["z"], rtol=1e-6)
    assert ours["dropped_tokens"] == 0  # dropless


@pytest.mark.parametrize("k,factor", [(1, 1.0), (2, 1.0), (2, 0.5), (2, 1.25)])
def test_dropped_tokens_under_a_capacity_equal_the_numpy_reference(k, factor):
    logits = fixed_logits()
    ours = route(tf.constant(logits), k, "after_topk", capacity_factor=factor)
    ref = numpy_route(logits, k, "after_topk", factor)
    assert ref["dropped"] > 0
    assert float(ours["dropped_tokens"]) == ref["dropped"]
    np.testing.assert_array_equal(np.asarray(ours["kept"]).T, ref["weights"] != 0)
    np.testing.assert_allclose(np.asarray(ours["weights"]).T, ref["weights"], rtol=1e-6)


def swiglu(x, gate, up, down):
    g = x @ gate
    return (g / (1 + np.exp(-g)) * (x @ up)) @ down


def make_moe(shared=0, capacity_factor=0.0, k=2, seed=0):
    keras.utils.set_random_seed(seed)
    moe = SparseMoE(16, 24, 4, k, capacity_factor=capacity_factor,
                    shared_intermediate_size=shared, initializer_range=0.3)
    moe.build((None, None, 16))
    return moe


def dense_reference(moe, x):
    """Every expert on every token, combined with the router's weights (0 off its top k)."""
    tokens = x.reshape(-1, 16)
    logits = tokens @ moe.router.kernel.numpy()
    ref = numpy_route(logits, moe.experts_per_token, moe.router_softmax, moe.capacity_factor)
    combine = np.zeros((len(tokens), 4))
    for slot in range(moe.experts_per_token):
        combine[np.arange(len(tokens)), ref["experts"][:, slot]] += ref["weights"][:, slot]
    gate, up, down = (w.numpy() for w in (moe.experts.gate, moe.experts.up, moe.experts.down))
    y = sum(combine[:, e:e + 1] * swiglu(tokens, gate[e], up[e], down[e]) for e in range(4))
    if moe.shared is not None:
        y = y + swiglu(tokens, *(w.numpy()[0] for w in (
            moe.shared.gate, moe.shared.up, moe.shared.down)))
    return y.reshape(x.shape)


@pytest.mark.parametrize("shared,factor,k", [(0, 0.0, 2), (20, 0.0, 2), (0, 0.0, 1),
                                             (0, 1.0, 2)])
def test_the_moe_layer_equals_a_dense_loop_over_every_expert(shared, factor, k):
    moe = make_moe(shared, factor, k)
    x = np.random.default_rng(1).standard_normal((3, 7, 16)).astype("float32")
    y, stats = moe(tf.constant(x))
    np.testing.assert_allclose(y.numpy(), dense_reference(moe, x), rtol=1e-4, atol=1e-5)
    assert float(tf.reduce_sum(stats["tokens_per_expert"])) == 21 * k
    assert (float(stats["dropped_tokens"]) > 0) == (factor > 0)


def test_the_moe_layer_gradients_equal_the_dense_loop():
    """Gradients of router and experts through the sparse dispatch equal those of the dense
    loop written in TensorFlow (same weights, same loss)."""
    moe = make_moe()
    x = tf.constant(np.random.default_rng(2).standard_normal((2, 5, 16)).astype("float32"))

    def dense(x):
        tokens = tf.reshape(x, (-1, 16))
        logits = tokens @ moe.router.kernel
        top, experts = tf.math.top_k(logits, 2)
        weights = tf.nn.softmax(top)
        combine = tf.reduce_sum(tf.one_hot(experts, 4) * weights[..., None], 1)  # (N, E)
        out = 0.0
        for e in range(4):
            g = tokens @ moe.experts.gate[e]
            out += combine[:, e:e + 1] * ((tf.nn.silu(g) * (tokens @ moe.experts.up[e]))
                                          @ moe.experts.down[e])
        return out

    target = tf.constant(np.random.default_rng(3).standard_normal((10, 16)).astype("float32"))
    grads = []
    for fn in (lambda x: tf.reshape(moe(x)[0], (-1, 16)), dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((fn(x) - target) ** 2)
        grads.append(tape.gradient(loss, moe.trainable_variables))
    for ours, ref, v in zip(*grads, moe.trainable_variables):
        assert float(tf.reduce_max(tf.abs(ref))) > 0, v.path
        np.testing.assert_allclose(tf.convert_to_tensor(ours), ref, rtol=1e-4, atol=1e-6,
                                   err_msg=v.path)


def test_the_moe_llama_counts_its_parameters_and_returns_routing_per_layer():
    config = LlamaConfig.from_preset("tiny-moe", vocab_size=97, shared_intermediate_size=8)
    keras.utils.set_random_seed(0)
    model = Llama(config)
    model.build((None, None))
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == config.num_params()
    gated = LlamaConfig.from_preset("tiny-moe", vocab_size=97, shared_intermediate_size=8,
                                    shared_expert_gate=True)  # Qwen2-MoE: + C per block
    gated_model = Llama(gated)
    gated_model.build((None, None))
    assert sum(int(np.prod(v.shape)) for v in gated_model.trainable_variables) == \
        gated.num_params() == config.num_params() + 2 * 32
    dense = LlamaConfig.from_preset("tiny-moe", vocab_size=97, num_experts=0)
    # per layer: the router, k = 2 experts of width 64 and the shared width 8 for the dense MLP
    assert config.active_params() == dense.num_params() + 2 * (
        32 * 4 + 3 * 32 * (2 * 64 + 8) - 3 * 32 * 64)
    assert config.num_params() - config.active_params() == 2 * 3 * 32 * 2 * 64
    ids = np.random.default_rng(0).integers(0, 97, (2, 9)).astype("int32")
    logits, routing = model(ids, return_routing=True)
    assert logits.shape == (2, 9, 97)
    assert routing["tokens_per_expert"].shape == (2, 4)
    np.testing.assert_array_equal(tf.reduce_sum(routing["tokens_per_expert"], 1), [36, 36])
    np.testing.assert_allclose(model(ids).numpy(), logits.numpy())
    assert model.layout().experts == ("blocks.*.mlp",)


@pytest.mark.parametrize("fields,flag", [(dict(experts_per_token=3), "--experts_per_token=3"),
                                         (dict(num_experts=2, experts_per_token=2,
                                               capacity_factor=-1.0), "--capacity_factor=-1"),
                                         (dict(num_experts=1, experts_per_token=2),
                                          "--experts_per_token=2"),
                                         (dict(router_softmax="sigmoid"), "--router_softmax")])
def test_a_bad_moe_setting_is_refused_by_name(fields, flag):
    with pytest.raises(ValueError, match=flag):
        LlamaConfig.from_preset("tiny-moe", **fields)


def test_the_moe_llama_generates_with_its_cache_as_with_full_recomputation():
    """Greedy tokens from the key/value cache (prefill, then one token at a time) equal those
    of recomputing the whole sequence each step (the MoE MLP routes each new token alone)."""
    from tfbig.models.generation import Generator

    keras.utils.set_random_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny-moe", vocab_size=97, initializer_range=0.2))
    model.build((None, None))
    prompt = np.random.default_rng(1).integers(0, 97, (2, 5)).astype("int32")
    cached = np.asarray(Generator(model)(prompt, 6, temperature=0.0))
    tokens = prompt
    for _ in range(6):
        tokens = np.concatenate([tokens, np.argmax(model(tokens).numpy()[:, -1:], -1)], 1)
    np.testing.assert_array_equal(cached, tokens.astype(cached.dtype))
