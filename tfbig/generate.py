"""Text generation from a trained GPT with a key/value cache: `tfbig-generate`.

Decoding uses a fixed-size cache and one XLA-compiled step of static shape, so token 200 costs
what token 10 costs (benchmarks/generation.py measures it).

Example:
    tfbig-generate --model_dir=runs/gpt-small --prompt="ROMEO" --max_new_tokens=100
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # console script: no C++ INFO lines

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags  # noqa: E402

from tfbig import integrity  # noqa: E402
from tfbig.checkpoint import model_variables  # noqa: E402
from tfbig.distribute import tensor_layout, zero_checkpoint  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402
from tfbig.models.gpt import GPT, GPTConfig  # noqa: E402
from tfbig.models.llama import Llama, LlamaConfig  # noqa: E402
from tfbig.pipeline import stage_checkpoint  # noqa: E402


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
        self._prefill = tf.function(model.call_with_cache, jit_compile=jit_compile)
        self._decode = tf.function(model.call_with_cache, jit_compile=jit_compile)

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


DECODERS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}  # model_format -> classes


def load_model(model_dir):
    """The GPT or Llama in `model_dir` (config.json + latest checkpoint) and its tokenizer path."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model_dir={model_dir} has no config.json; train a model "
                                f"there with tfbig-train first")
    with open(path) as f:
        saved = json.load(f)
    family = saved.get("model_format", "gpt")
    if family not in DECODERS:
        raise ValueError(f"--model_dir={model_dir} holds a {family} model; "
                         f"tfbig-generate needs a GPT or a Llama")
    warn = lambda m: print(m, file=sys.stderr)  # noqa: E731
    latest, _ = integrity.newest_intact(model_dir, warn=warn)
    if latest is None:
        raise FileNotFoundError(f"--model_dir={model_dir} has no checkpoint")
    model_class, config_class = DECODERS[family]
    model = model_class(config_class(**saved["model_config"]), name=family)
    model.build((None, None))
    pieces = next((m for m in (tensor_layout, stage_checkpoint, zero_checkpoint)  # per-rank pieces
                   if m.read_layout(model_dir) is not None), None)
    if pieces is not None:
        weights = pieces.assembled_weights(model_dir, model, warn)
        for v in model.variables:
            if v.path in weights:
                v.assign(weights[v.path])
        return model, os.path.join(model_dir, "tokenizer.model")
    status = tf.train.Checkpoint(model=model_variables(model)).restore(latest)
    status.assert_existing_objects_matched().expect_partial()  # every weight, not the optimizer
    return model, os.path.join(model_dir, "tokenizer.model")


FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("model_dir", None, "Run directory written by tfbig-train.")
    flags.DEFINE_string("prompt", "", "Text to continue (empty: start from end-of-document).")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling probability mass (1: all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.mark_flag_as_required("model_dir")


def sample_text(model, tokenizer, prompt, max_new_tokens, temperature=0.8, top_k=0, top_p=1.0,
                seed=0):
    """Generate a continuation of `prompt` and return prompt + continuation as text."""
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
    out = Generator(model)([ids], max_new_tokens, temperature, top_k, top_p, seed)
    return tokenizer.decode([int(t) for t in out[0] if t != tokenizer.eos_id])


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; the prompt goes in --prompt")
    from tfbig.data.tokenizer import for_run

    model, _ = load_model(FLAGS.model_dir)
    text = sample_text(model, for_run(FLAGS.model_dir), FLAGS.prompt,
                       FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.top_p,
                       FLAGS.seed)
    print(text)


def run():
    from tfbig import cli

    define_flags()
    cli.run_app("tfbig-generate", main, __doc__, [("generate", cli.own_flags())])
