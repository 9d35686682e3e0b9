"""Autoregressive sampling with a key/value cache: one compiled prefill and one decode step.

Decoding uses a fixed-size cache and one XLA-compiled step of static shape, so token 200 costs
what token 10 costs (benchmarks/generation.py measures it). A model here is any of tfbig's
families that has `call_with_cache` and `init_cache`.
"""
import numpy as np
import tensorflow as tf


def _filter_logits(logits, top_k, top_p):
    """Mask all but the top_k logits and the smallest set whose probability exceeds top_p."""
    if top_k:
        kth = tf.math.top_k(logits, k=top_k).values[:, -1:]
        logits = tf.where(logits < kth, -1e9, logits)
    if 0.0 < top_p < 1.0:
        sorted_logits = tf.sort(logits, direction="DESCENDING", axis=-1)
        cumulative = tf.cumsum(tf.nn.softmax(sorted_logits), axis=-1, exclusive=True)
        cutoff = tf.reduce_min(tf.where(cumulative < top_p, sorted_logits, 1e9), axis=-1,
                               keepdims=True)
        logits = tf.where(logits < cutoff, -1e9, logits)
    return logits


def _next_token(logits, temperature, top_k, top_p, seed):
    """(B, V) float32 logits -> (B,) int32 tokens; temperature 0 is greedy."""
    if temperature <= 0:
        return tf.argmax(logits, axis=-1, output_type=tf.int32)
    logits = _filter_logits(logits / temperature, top_k, top_p)
    return tf.random.stateless_categorical(logits, 1, seed, dtype=tf.int32)[:, 0]


class Generator:
    """Autoregressive sampling for one model with a compiled prefill and decode step."""

    def __init__(self, model, jit_compile=True):
        self.model = model
        # XLA compiles for one device: a model split over devices (pipeline stages) runs unjitted.
        jit_compile = jit_compile and len({v.value.device for v in model.trainable_variables}) < 2
        # MoE layers' expert groups have data-dependent sizes XLA cannot compile
        jit_compile = jit_compile and not getattr(getattr(model, "config", None), "num_experts", 0)
        self._prefill, self._decode = (
            tf.function(model.call_with_cache, jit_compile=jit_compile, autograph=False)
            for _ in range(2))

    def __call__(self, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                 seed=0, use_cache=True):
        """prompt_ids: (B, P) ints -> (B, P + max_new_tokens) int32 numpy array."""
        prompt_ids = np.asarray(prompt_ids, np.int32)
        total = prompt_ids.shape[1] + max_new_tokens
        if prompt_ids.shape[1] == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if total > self.model.config.seq_length:
            raise ValueError(f"prompt ({prompt_ids.shape[1]} tokens) + --max_new_tokens "
                             f"({max_new_tokens}) = {total} is above the model's position "
                             f"table (seq_length={self.model.config.seq_length})")
        step = self._step_cached if use_cache else self._step_full
        return step(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed)

    def _step_cached(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed):
        batch, length = prompt_ids.shape
        cache = self.model.init_cache(batch, self.model.config.seq_length)
        logits, cache = self._prefill(tf.constant(prompt_ids), cache, tf.constant(0))
        tokens = [prompt_ids]
        for i in range(max_new_tokens):
            token = _next_token(logits[:, -1], temperature, top_k, top_p, [seed, i])
            tokens.append(token.numpy()[:, None])
            if i + 1 < max_new_tokens:
                logits, cache = self._decode(token[:, None], cache, tf.constant(length + i))
        return np.concatenate(tokens, axis=1)

    def _step_full(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed):
        ids = prompt_ids
        for i in range(max_new_tokens):
            logits = self.model(ids)[:, -1]
            token = _next_token(logits, temperature, top_k, top_p, [seed, i])
            ids = np.concatenate([ids, token.numpy()[:, None]], axis=1)
        return ids


def sample_text(model, tokenizer, prompt, max_new_tokens, temperature=0.8, top_k=0, top_p=1.0,
                seed=0):
    """Generate a continuation of `prompt` and return prompt + continuation as text."""
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
    out = Generator(model)([ids], max_new_tokens, temperature, top_k, top_p, seed)
    return tokenizer.decode([int(t) for t in out[0] if t != tokenizer.eos_id])
