#!/usr/bin/env python3
"""Training-step throughput of tfbig's GPT and Llama (their Keras 3 model code, dense or blockwise
attention) against keras-hub's GPT-2 and Llama of the same dimensions, and the measured bf16
matmul peak, on one GPU that has JAX but no TensorFlow.

The team's GPU-proxy kit (shared/gpu-proxy) with the blockwise and Llama configs added; run by
benchmarks/gpu_proxy/run.sh, its figures are in benchmarks/results/gpu_proxy.jsonl.

A PROXY: tfbig trains with TensorFlow; here the same Keras model code (tfbig.models.gpt) is
traced by Keras' JAX backend and compiled by JAX's XLA. The TensorFlow runtime is not measured.

Each model: mixed_bfloat16, one jitted step = forward (model.stateless_call) + mean sparse softmax
cross-entropy of next-token prediction (float32 logits) + grads (jax.value_and_grad) + optax
AdamW (fp32 state), the state buffers donated. Compile (timed), 3 warm-up steps, then timed steps
until a target wall time. One JSON line per model and one ratio line per config.

    KERAS_BACKEND=jax python3 bench.py            # GPU run (about 5 minutes on an H100)
    KERAS_BACKEND=jax python3 bench.py --small    # CPU smoke test: tiny dims, loss must fall
    KERAS_BACKEND=jax python3 bench.py --count-only   # params of both models at the GPU dims
    KERAS_BACKEND=jax python3 bench.py --small --configs=small-cpu-blockwise,small-cpu-llama
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import warnings

PROXY_LINE = ("proxy: tfbig's Keras model code compiled by XLA through Keras' JAX backend; "
              "the TensorFlow runtime is not measured")
H100_SXM_BF16_DENSE_TFLOPS = 989.4  # spec sheet, dense (no sparsity)
START = time.perf_counter()


@dataclasses.dataclass
class Cfg:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    family: str = "gpt"  # gpt: tfbig GPT vs keras-hub GPT-2; llama: tfbig Llama vs keras-hub Llama
    kinds: tuple = ("tfbig", "keras-hub")  # models run, in order; tfbig-blockwise: --attention
    kv_heads: int = 0  # llama: key/value heads (grouped-query attention)
    intermediate: int = 0  # llama: SwiGLU width


# Batches sized for 80 GB (JAX keeps 0.92) with fp32 params + AdamW m, v and the explicit
# attention of tfbig (and of keras-hub without cuDNN flash attention): JAX's default softmax VJP
# saves ~11 bytes per attention score (bool mask, f32 scores, f32 exp, bf16 probs) per layer.
# XLA's memory analysis on CPU at 1 and 3 layers, extrapolated to 24 (args + temp, GB):
#   medium B=8: 61 (B=12: 89, B=16: ~120)      1.3b B=2: 73 (B=1: 44)
# keras-hub on the XLA attention path needs the same within 2%. The GPU's compiled memory
# analysis is checked before the first step, and a batch that does not fit is halved.
GPU_CONFIGS = [Cfg("gpt2-medium-like", 24, 1024, 16, 1024, 50304, 8),
               Cfg("1.3b-like", 24, 2048, 16, 2048, 50304, 2)]
# Run only when named with --configs: the sequence-length wall (batch 1).
SEQ_CONFIGS = [Cfg("355m-seq4k", 24, 1024, 16, 4096, 50304, 1),
               Cfg("355m-seq8k", 24, 1024, 16, 8192, 50304, 1)]
# Blockwise attention (tfbig.models.attention, --attention=blockwise) where dense attention
# needs the most memory, and the Llama family (a Llama 3.2 1B-shaped decoder: GQA 32/8 heads,
# SwiGLU 8192, vocab 128256, tied) against keras-hub's Llama with cuDNN fused attention.
LONG_CONFIGS = [
    Cfg("355m-seq8k-blockwise", 24, 1024, 16, 8192, 50304, 1,
        kinds=("tfbig-blockwise", "keras-hub", "tfbig")),
    Cfg("llama-1b-seq2k", 16, 2048, 32, 2048, 128256, 2, family="llama",
        kinds=("tfbig", "tfbig-blockwise", "keras-hub"), kv_heads=8, intermediate=8192),
    Cfg("llama-1b-seq8k", 16, 2048, 32, 8192, 128256, 1, family="llama",
        kinds=("tfbig-blockwise", "keras-hub"), kv_heads=8, intermediate=8192),
]
SMALL_CONFIGS = [Cfg("small-cpu", 2, 64, 4, 64, 512, 4)]
SMALL_LONG_CONFIGS = [
    Cfg("small-cpu-blockwise", 2, 64, 4, 128, 512, 2, kinds=("tfbig-blockwise", "keras-hub")),
    Cfg("small-cpu-llama", 2, 64, 4, 128, 512, 2, family="llama",
        kinds=("tfbig", "tfbig-blockwise", "keras-hub"), kv_heads=2, intermediate=160)]


def emit(obj):
    print(json.dumps(obj), flush=True)


def first_line(exc):
    text = f"{type(exc).__name__}: {exc}"
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return type(exc).__name__


def is_oom(exc):
    text = str(exc).lower()
    return ("resource_exhausted" in text or "out of memory" in text
            or "resource exhausted" in text or isinstance(exc, MemoryError)
            or "would not fit" in text)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny dims, CPU smoke test")
    p.add_argument("--count-only", action="store_true",
                   help="build both models at the configs' dims, print params, exit")
    p.add_argument("--configs", default="", help="comma-separated config names (default all)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="wall budget of the whole script; models are trimmed/skipped to fit")
    p.add_argument("--target-s", type=float, default=20.0, help="timed seconds per model")
    p.add_argument("--cap-s", type=float, default=25.0, help="max timed seconds per model")
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (1e-4; --small: 1e-3)")
    p.add_argument("--loss-steps", type=int, default=20,
                   help="--small: steps on one fixed batch whose losses are printed")
    p.add_argument("--softmax-custom-jvp", action="store_true",
                   help="jax_softmax_custom_jvp=True (saves only the softmax output, as TF's "
                        "gradient does); default: JAX's default")
    p.add_argument("--mem-limit-gb", type=float, default=None,
                   help="pretend the device has this many GB (tests the OOM halving on CPU)")
    p.add_argument("--block-size", type=int, default=512,
                   help="tfbig-blockwise: rows of the query and key tiles")
    p.add_argument("--no-extras", action="store_true",
                   help="skip the extra keras-hub run with flash attention disabled")
    args = p.parse_args()
    if args.lr is None:
        args.lr = 1e-3 if args.small else 1e-4
    if args.small:
        args.target_s, args.cap_s = min(args.target_s, 2.0), min(args.cap_s, 3.0)
    return args


def main():
    print(PROXY_LINE, flush=True)
    args = parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    warnings.filterwarnings("ignore", message=".*donated buffers.*")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import keras

    if args.softmax_custom_jvp:
        jax.config.update("jax_softmax_custom_jvp", True)
    versions = {"python": sys.version.split()[0], "jax": jax.__version__,
                "keras": keras.__version__, "optax": optax.__version__, "numpy": np.__version__}
    try:
        import jaxlib
        versions["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import keras_hub
        versions["keras_hub"] = keras_hub.__version__
    except Exception as e:  # noqa: BLE001 - reported, tfbig still runs
        emit({"error": "import keras_hub failed", "detail": first_line(e)})
    devices = jax.devices()
    print("jax.devices():", devices, flush=True)
    dev = devices[0]
    print("GPU name:" if dev.platform == "gpu" else "device:", dev.device_kind, flush=True)
    emit({"env": versions, "backend": keras.backend.backend(), "platform": dev.platform,
          "device_kind": dev.device_kind, "device_count": len(devices),
          "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
          "jax_softmax_custom_jvp": bool(jax.config.jax_softmax_custom_jvp),
          "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")})
    if dev.platform != "gpu" and not (args.small or args.count_only):
        emit({"error": f"no GPU: JAX runs on {dev.platform} (CUDA plugin not loaded?); the GPU "
                       "configs would not finish on it. Use --small for a CPU smoke test."})
        sys.exit(2)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")

    configs = SMALL_CONFIGS if args.small else GPU_CONFIGS
    if args.configs:
        wanted = args.configs.split(",")
        every = (SMALL_CONFIGS + SMALL_LONG_CONFIGS if args.small
                 else GPU_CONFIGS + SEQ_CONFIGS + LONG_CONFIGS)
        unknown = set(wanted) - {c.name for c in every}
        if unknown:
            sys.exit(f"--configs: unknown {sorted(unknown)}; known: {[c.name for c in every]}")
        configs = [c for name in wanted for c in every if c.name == name]

    if args.count_only:
        for cfg in configs:
            count_params(cfg, keras)
        return

    peak = matmul_peak(jax, jnp, n=512 if args.small else 8192)

    bench = Bench(args, peak, jax, jnp, np, optax, keras)
    # (config, kind, flash) in priority order; extras run only if time is left over.
    plan = [(cfg, kind, None) for cfg in configs for kind in cfg.kinds]
    extras = ([] if args.no_extras or not configs or "keras-hub" not in configs[0].kinds
              else [(configs[0], "keras-hub", False)])
    results = {}
    for i, (cfg, kind, flash) in enumerate(plan):
        results[(cfg.name, kind)] = bench.run(cfg, kind, flash, models_left=len(plan) - i)
        if kind == "keras-hub":
            for mine in cfg.kinds:
                if mine.startswith("tfbig") and (cfg.name, mine) in results:
                    ratio_line(cfg, results[(cfg.name, mine)], results[(cfg.name, kind)],
                               label=f"{mine}/keras-hub")
        elif kind != cfg.kinds[0] and (cfg.name, "keras-hub") in results:
            ratio_line(cfg, results[(cfg.name, kind)], results[(cfg.name, "keras-hub")],
                       label=f"{kind}/keras-hub")
    for cfg in configs:
        if {"tfbig", "tfbig-blockwise"} <= set(cfg.kinds):
            ratio_line(cfg, results.get((cfg.name, "tfbig-blockwise")),
                       results.get((cfg.name, "tfbig")), label="tfbig-blockwise/tfbig")
    for cfg, kind, flash in extras:
        hub = results.get((cfg.name, "keras-hub"))
        if hub and "disabled" in hub["model"]:
            continue  # the main keras-hub run already fell back to XLA attention
        res = bench.run(cfg, kind, flash, models_left=1, optional=True)
        if res is not None:
            mine = next(k for k in cfg.kinds if k.startswith("tfbig"))
            ratio_line(cfg, results.get((cfg.name, mine)), res,
                       label=f"{mine}/keras-hub(flash attention disabled)")
    emit({"done": True, "total_s": round(time.perf_counter() - START, 1)})


def ratio_line(cfg, a, b, label="tfbig/keras-hub"):
    line = {"config": cfg.name, "ratio": label}
    if a and b and a.get("tokens_per_s") and b.get("tokens_per_s"):
        line["tokens_per_s_ratio"] = round(a["tokens_per_s"] / b["tokens_per_s"], 4)
        line["batch_tfbig"], line["batch_kerashub"] = a["batch"], b["batch"]
        if a["batch"] != b["batch"]:
            line["note"] = "batches differ (an OOM halved one)"
    else:
        line["tokens_per_s_ratio"] = None
        line["note"] = "a model failed or was skipped"
    emit(line)


def matmul_peak(jax, jnp, n, min_s=2.0):
    """bf16 n x n @ n x n, jitted: 3 warm-ups, then batches of 10 calls until min_s."""
    try:
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        f = jax.jit(lambda a, b: a @ b)
        for _ in range(3):
            f(a, b).block_until_ready()
        calls, t0 = 0, time.perf_counter()
        while True:
            for _ in range(10):
                out = f(a, b)
            out.block_until_ready()
            calls += 10
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        tflops = 2 * n ** 3 * calls / dt / 1e12
        emit({"matmul_peak": {"n": n, "dtype": "bfloat16", "calls": calls,
                              "seconds": round(dt, 3), "tflops": round(tflops, 1),
                              "vs_989.4_spec": round(tflops / H100_SXM_BF16_DENSE_TFLOPS, 3)}})
        del a, b, out
        return tflops
    except Exception as e:  # noqa: BLE001
        emit({"matmul_peak": None, "error": first_line(e)})
        return None


def build_model(cfg, kind, keras, block_size=512):
    """(model, forward(trainable, non_trainable, token_ids) -> (logits, non_trainable), extra)."""
    from keras import ops
    if kind.startswith("tfbig"):
        attention = "blockwise" if kind == "tfbig-blockwise" else "dense"
        if cfg.family == "llama":
            config = _tfbig_llama_config(cfg, attention, block_size)
            from tfbig.models.llama import Llama
            model = Llama(config, name="tfbig_llama")
        else:
            from tfbig.models.gpt import GPT, GPTConfig
            config = GPTConfig(vocab_size=cfg.vocab, seq_length=cfg.seq, num_layers=cfg.layers,
                               hidden_size=cfg.hidden, num_heads=cfg.heads, dropout=0.0,
                               attention=attention, attention_block_size=block_size)
            model = GPT(config, name="tfbig_gpt")
        model.build((None, cfg.seq))

        def forward(tv, ntv, x):
            return model.stateless_call(tv, ntv, x, training=True)

        extra = {"params_closed_form": config.num_params(),
                 "attention": ("explicit einsum, float32 softmax" if attention == "dense" else
                               f"tfbig blockwise (online softmax, {block_size}-row tiles, "
                               "recomputing backward)")}
        return model, forward, extra
    import keras_hub
    if cfg.family == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=cfg.vocab, num_layers=cfg.layers, num_query_heads=cfg.heads,
            hidden_dim=cfg.hidden, intermediate_dim=cfg.intermediate,
            num_key_value_heads=cfg.kv_heads, rope_max_wavelength=500000.0,
            layer_norm_epsilon=1e-5, dropout=0.0, tie_word_embeddings=True)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=cfg.vocab, num_layers=cfg.layers, num_heads=cfg.heads,
            hidden_dim=cfg.hidden, intermediate_dim=4 * cfg.hidden, dropout=0.0,
            max_sequence_length=cfg.seq)
        # GPT2CausalLM = backbone + logits from the tied token embedding (reverse=True).
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    def forward(tv, ntv, x):
        inputs = {"token_ids": x, "padding_mask": ops.ones_like(x)}
        return model.stateless_call(tv, ntv, inputs, training=True)

    flash = "auto" if keras.config.is_flash_attention_enabled() is None else "disabled"
    extra = {"attention": f"keras-hub -> ops.dot_product_attention (flash attention {flash})"}
    return model, forward, extra


def _tfbig_llama_config(cfg, attention="dense", block_size=512):
    """tfbig's LlamaConfig of `cfg` (Llama 3.2 1B's rope theta and epsilon, tied embeddings)."""
    try:
        import tensorflow  # noqa: F401
        stub = False
    except ImportError:
        # tfbig.models.moe (imported by tfbig.models.llama) uses TensorFlow ops for its ragged
        # expert groups; a dense Llama never calls them. A placeholder module lets the import
        # through and is removed at once, so Keras' own lazy TensorFlow check still finds none.
        import types
        sys.modules["tensorflow"] = types.ModuleType("tensorflow")
        stub = True
    try:
        from tfbig.models.llama import LlamaConfig
    finally:
        if stub:
            del sys.modules["tensorflow"]
    return LlamaConfig(vocab_size=cfg.vocab, seq_length=cfg.seq, num_layers=cfg.layers,
                       hidden_size=cfg.hidden, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads,
                       intermediate_size=cfg.intermediate, rope_theta=500000.0,
                       tie_embeddings=True, dropout=0.0, attention=attention,
                       attention_block_size=block_size)


def flops_per_token(cfg):
    """Training FLOPs per token of both models of `cfg` (same dims): tfbig's closed form, 6 x
    matmul weights applied per token + 12 L C T of attention (PaLM appendix B)."""
    if cfg.family == "llama":
        return _tfbig_llama_config(cfg).flops_per_token()
    from tfbig.models.configs import GPTConfig
    return GPTConfig(vocab_size=cfg.vocab, seq_length=cfg.seq, num_layers=cfg.layers,
                     hidden_size=cfg.hidden, num_heads=cfg.heads).flops_per_token()


def count_params(cfg, keras):
    import numpy as np
    out = {"config": cfg.name}
    for kind in cfg.kinds:
        keras.backend.clear_session()
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            model, _, extra = build_model(cfg, kind, keras)
            out[kind] = int(sum(np.prod(v.shape) for v in model.trainable_variables))
            out[kind + "_non_trainable"] = len(model.non_trainable_variables)
            if "params_closed_form" in extra:
                out["tfbig_closed_form"] = extra["params_closed_form"]
            del model
        except Exception as e:  # noqa: BLE001
            out[kind] = None
            out[kind + "_error"] = first_line(e)
        gc.collect()
    if out.get("tfbig") and out.get("keras-hub"):
        out["hub_over_tfbig"] = round(out["keras-hub"] / out["tfbig"], 6)
    emit({"param_count": out})


class Bench:
    def __init__(self, args, peak, jax, jnp, np, optax, keras):
        self.args, self.peak = args, peak
        self.jax, self.jnp, self.np, self.optax, self.keras = jax, jnp, np, optax, keras
        self.deadline = START + args.budget_s
        self.overhead_s = 5.0 if args.small else 50.0  # build + compile + warm-ups; learnt
        self.batch = {}  # config name -> batch after any OOM halving

    def remaining(self):
        return self.deadline - time.perf_counter()

    def reset_keras(self, flash):
        self.jax.clear_caches()
        self.keras.backend.clear_session()  # also resets the dtype policy: set it again
        self.keras.mixed_precision.set_global_policy("mixed_bfloat16")
        if flash is False:
            self.keras.config.disable_flash_attention()
        gc.collect()

    def run(self, cfg, kind, flash, models_left, optional=False):
        """One model, retried with half the batch after an out-of-memory error and (keras-hub)
        without flash attention after another error, within the script's time budget."""
        name = kind if flash is None else f"{kind} (flash attention disabled)"
        batch = self.batch.get(cfg.name, cfg.batch)
        min_timed = 1.0 if self.args.small else 5.0
        tries = 0
        while True:
            # Every model left must still pay its build + compile + warm-ups (overhead_s);
            # the timed windows share what remains, but this one gets at least min_timed.
            share = (self.remaining() - models_left * self.overhead_s) / max(models_left, 1)
            timed_cap = max(min_timed, min(self.args.cap_s, share))
            if self.remaining() < self.overhead_s + timed_cap + (10.0 if optional else 0.0):
                if not optional:
                    emit({"model": name, "config": cfg.name, "skipped": "time budget",
                          "remaining_s": round(self.remaining(), 1)})
                return None
            res = self._run_once(cfg, kind, flash, name, batch, timed_cap)
            self.reset_keras(None)
            tries += 1
            if res.get("oom") and batch > 1 and tries < 3 and not optional:
                batch //= 2
                self.batch[cfg.name] = batch
                continue
            if (res.get("error") and not res.get("oom") and kind == "keras-hub"
                    and flash is None and tries < 2 and res.get("stage") != "build"
                    and not optional):
                # e.g. a cuDNN flash-attention failure on the device: retry with XLA attention.
                flash = False
                name = f"{kind} (flash attention disabled after an error)"
                continue
            return res if res.get("tokens_per_s") else None

    def _run_once(self, cfg, kind, flash, name, batch, timed_cap):
        jax, jnp, np, optax, keras = self.jax, self.jnp, self.np, self.optax, self.keras
        small = self.args.small
        out = {"model": name, "config": cfg.name, "layers": cfg.layers, "hidden": cfg.hidden,
               "heads": cfg.heads, "seq": cfg.seq, "vocab": cfg.vocab, "batch": batch}
        stage = "build"
        try:
            self.reset_keras(flash)
            t0 = time.perf_counter()
            model, forward, extra = build_model(cfg, kind, keras, self.args.block_size)
            out.update(extra)
            out["dtype_policy"] = model.dtype_policy.name
            params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
            out["params"] = params
            fpt = flops_per_token(cfg)
            out["flops_per_token"] = fpt
            tv = [v.value for v in model.trainable_variables]
            ntv = [v.value for v in model.non_trainable_variables]
            opt = optax.adamw(self.args.lr)
            opt_state = opt.init(tv)
            out["build_s"] = round(time.perf_counter() - t0, 2)

            def loss_fn(tv, ntv, x, y):
                logits, ntv = forward(tv, ntv, x)
                logits = logits.astype(jnp.float32)
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
                return loss, ntv

            def train_step(tv, ntv, opt_state, x, y):
                (loss, ntv), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv, ntv, x, y)
                updates, opt_state = opt.update(grads, opt_state, tv)
                tv = optax.apply_updates(tv, updates)
                return tv, ntv, opt_state, loss

            step = jax.jit(train_step, donate_argnums=(0, 1, 2))
            tokens = np.random.default_rng(0).integers(0, cfg.vocab, (batch, cfg.seq + 1),
                                                        dtype=np.int32)
            x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])

            stage = "trace"
            t0 = time.perf_counter()
            lowered = step.lower(tv, ntv, opt_state, x, y)
            out["trace_s"] = round(time.perf_counter() - t0, 2)
            stage = "compile"
            compiled = lowered.compile()
            del lowered
            compile_s = time.perf_counter() - t0
            out["compile_s"] = round(compile_s, 2)  # trace + XLA compile
            self._memory_analysis(compiled, out)
            try:
                out["cudnn_fmha_in_hlo"] = "cudnn$fmha" in compiled.as_text()
            except Exception:  # noqa: BLE001
                out["cudnn_fmha_in_hlo"] = None
            self._check_fits(out)

            stage = "warm-up"
            losses, warm = [], []
            n_loss = self.args.loss_steps if small else 3
            for _ in range(n_loss):
                t0 = time.perf_counter()
                tv, ntv, opt_state, loss = compiled(tv, ntv, opt_state, x, y)
                losses.append(float(loss))  # blocks
                warm.append(time.perf_counter() - t0)
            out["warmup_step_ms"] = [round(w * 1e3, 1) for w in warm[:3]]
            out["loss_first"] = round(losses[0], 4)
            if not all(math.isfinite(v) for v in losses):
                raise FloatingPointError(f"non-finite loss {losses}")
            if small:
                out["losses_fixed_batch"] = [round(v, 4) for v in losses]
                out["loss_fell"] = losses[-1] < losses[0] - 0.05
            self.overhead_s = max(5.0 if small else 20.0,
                                  out["build_s"] + compile_s + sum(warm[:3]) + 5.0)

            stage = "timed"
            est = max(min(warm[-3:]), 1e-4)
            flops_est = batch * cfg.seq * fpt / (0.4 * H100_SXM_BF16_DENSE_TFLOPS * 1e12)
            out["est_step_ms_at_40pct_mfu"] = round(flops_est * 1e3, 1)
            target = max(3, math.ceil(min(self.args.target_s, timed_cap) / est))
            chunk = max(1, min(target, int(0.5 / est)))
            steps, t0 = 0, time.perf_counter()
            while steps < target:
                for _ in range(min(chunk, target - steps)):
                    tv, ntv, opt_state, loss = compiled(tv, ntv, opt_state, x, y)
                loss.block_until_ready()
                steps += min(chunk, target - steps)
                if time.perf_counter() - t0 > timed_cap:
                    break
            dt = time.perf_counter() - t0
            out["loss_last"] = round(float(loss), 4)
            out["steps_timed"] = steps
            out["timed_s"] = round(dt, 2)
            step_s = dt / steps
            tok_s = batch * cfg.seq / step_s
            tflops = fpt * tok_s / 1e12
            out["step_ms"] = round(step_s * 1e3, 2)
            out["tokens_per_s"] = round(tok_s, 1)
            out["model_tflops"] = round(tflops, 2)
            out["mfu_vs_989.4"] = round(tflops / H100_SXM_BF16_DENSE_TFLOPS, 4)
            out["mfu_vs_measured_peak"] = round(tflops / self.peak, 4) if self.peak else None
            stats = _memory_stats(jax)
            if stats:
                out["peak_gb_in_use_so_far"] = round(stats.get("peak_bytes_in_use", 0) / 1e9, 2)
                out["bytes_limit_gb"] = round(stats.get("bytes_limit", 0) / 1e9, 2)
            out["ok"] = True
            del tv, ntv, opt_state, compiled, model
        except Exception as e:  # noqa: BLE001 - one model's failure must not stop the others
            out["ok"] = False
            out["stage"] = stage
            out["error"] = first_line(e)
            out["oom"] = is_oom(e)
            del e
        out["wall_s_so_far"] = round(time.perf_counter() - START, 1)
        out = {k: v for k, v in out.items() if not k.startswith("_")}
        emit(out)
        return out

    def _check_fits(self, out):
        """Raise a (predicted) out-of-memory error if the step's new buffers exceed what is free.
        The arguments (params, optimizer state, batch) are already allocated; the outputs alias
        the donated arguments, so the step allocates its temp buffers (+ unaliased outputs)."""
        stats = _memory_stats(self.jax)
        limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
        if self.args.mem_limit_gb:
            limit = self.args.mem_limit_gb * 1e9
            in_use = out.get("_args_b", 0)
        if not limit or "_new_b" not in out:
            return
        free = limit - in_use
        out["free_gb_before_step"] = round(free / 1e9, 2)
        if out["_new_b"] > 0.97 * free:
            raise MemoryError(f"RESOURCE_EXHAUSTED (predicted from XLA's memory analysis): the "
                              f"step needs {out['_new_b'] / 1e9:.2f} GB more, "
                              f"{free / 1e9:.2f} GB free")

    @staticmethod
    def _memory_analysis(compiled, out):
        try:
            m = compiled.memory_analysis()
            if m is None:
                return
            args_b = getattr(m, "argument_size_in_bytes", 0)
            temp_b = getattr(m, "temp_size_in_bytes", 0)
            outp_b = getattr(m, "output_size_in_bytes", 0)
            alias_b = getattr(m, "alias_size_in_bytes", 0)
            out["xla_args_gb"] = round(args_b / 1e9, 2)
            out["xla_temp_gb"] = round(temp_b / 1e9, 2)
            out["xla_total_gb"] = round((args_b + temp_b + outp_b - alias_b) / 1e9, 2)
            out["_args_b"], out["_new_b"] = args_b, temp_b + max(outp_b - alias_b, 0)
        except Exception:  # noqa: BLE001
            pass


def _memory_stats(jax):
    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        return {}


if __name__ == "__main__":
    main()
