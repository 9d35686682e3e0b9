"""Per-token decoding time with the key/value cache: token 200 should cost about what token 10 does.

    python benchmarks/generation.py --preset=small --new_tokens=220

Times every decoded token (greedy, batch 1) after one warm-up generation, reports the median of
tokens 5..15 and 195..205 over repeats, their ratio (goal <= 2), and the same for decoding
without the cache (the whole prefix recomputed per token) for comparison. One JSON line last.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from tfbig.models.generation import Generator  # noqa: E402
from tfbig.models.gpt import GPT, GPTConfig  # noqa: E402

flags.DEFINE_string("preset", "small", "GPT preset to time.")
flags.DEFINE_integer("new_tokens", 220, "Tokens to decode per run (must exceed 205).")
flags.DEFINE_integer("repeats", 3, "Timed generations; medians are over all of them.")
FLAGS = flags.FLAGS


def per_token_times(generator, model, prompt, new_tokens, use_cache):
    """Wall time of each decoded token, measured around one decode step."""
    times = []
    if use_cache:
        cache = model.init_cache(1, model.config.seq_length)
        logits, cache = generator._prefill(tf.constant(prompt), cache, tf.constant(0))
        token = tf.argmax(logits[:, -1], axis=-1, output_type=tf.int32)
        for i in range(new_tokens):
            start = time.perf_counter()
            logits, cache = generator._decode(token[:, None], cache,
                                              tf.constant(prompt.shape[1] + i))
            token = tf.argmax(logits[:, -1], axis=-1, output_type=tf.int32)
            token.numpy()
            times.append(time.perf_counter() - start)
    else:
        ids = prompt
        for _ in range(new_tokens):
            start = time.perf_counter()
            token = tf.argmax(model(ids)[:, -1], axis=-1, output_type=tf.int32).numpy()
            ids = np.concatenate([ids, token[:, None]], axis=1)
            times.append(time.perf_counter() - start)
    return np.array(times)


def main(argv):
    del argv
    keras.utils.set_random_seed(0)
    config = GPTConfig.from_preset(FLAGS.preset)
    config.seq_length = max(config.seq_length, FLAGS.new_tokens + 8)
    model = GPT(config)
    model.build((None, config.seq_length))
    generator = Generator(model)
    prompt = np.array([[1, 2, 3, 4]], np.int32)
    result = {"preset": FLAGS.preset}
    for use_cache in (True, False):
        per_token_times(generator, model, prompt, FLAGS.new_tokens, use_cache)  # warm up
        runs = np.stack([per_token_times(generator, model, prompt, FLAGS.new_tokens, use_cache)
                         for _ in range(FLAGS.repeats)])
        early, late = np.median(runs[:, 5:16]), np.median(runs[:, 195:206])
        key = "cache" if use_cache else "no_cache"
        result[f"{key}_ms_token_10"] = round(early * 1e3, 3)
        result[f"{key}_ms_token_200"] = round(late * 1e3, 3)
        result[f"{key}_ratio"] = round(late / early, 3)
        print(f"{key}: token 10 {early * 1e3:.2f} ms, token 200 {late * 1e3:.2f} ms, "
              f"ratio {late / early:.2f}")
    result["ratio"] = result["cache_ratio"]
    _record.emit(result)


if __name__ == "__main__":
    app.run(main)
