"""tfbig GPT vs keras-hub's GPT2 (GPT2Backbone + tied vocabulary projection), or with
--model=llama tfbig's Llama vs keras-hub's LlamaCausalLM (LlamaBackbone: RoPE, RMSNorm,
SwiGLU, grouped-query attention, the untied or tied head as the preset says), trained alike.

Both sides get the same dimensions (the --preset), batch, sequence length, data (the same
prepared shards through tfbig.data), optimizer (tfbig.optim.build_optimizer: AdamW, warmup +
cosine, weight decay off for norms/biases/embeddings, global-norm clipping), precision and
XLA; dropout 0 on both. tfbig trains with its `Trainer`; keras-hub the way its users do,
`GPT2CausalLM.compile(jit_compile=True)` + `fit`. Each trains 1 + --steps steps; the first
(compilation) is left out and tokens/s covers the --steps after it (input wait included),
timed from the end of step 1 to the end of the last step on both sides, in wall time and in
CPU time of the process (`ratio_cpu`: robust to other processes taking cores of a shared
machine). The two alternate for --repeats rounds (order swapped each round) and the best
round of each is reported.
MFU uses the same model FLOPs per token (the architectures are identical; parameter counts
are checked equal) and a CPU matmul peak probed before every run (the best probe); the
`*_mfu_cpu_time` figures divide tokens per CPU-second by the probe's FLOP per CPU-second,
which stays meaningful while other processes share the cores.

    python benchmarks/vs_keras_hub.py --preset=small --batch_size=16 --seq_length=256
    python benchmarks/vs_keras_hub.py --model=llama --preset=small

Prints one JSON line last: tokens/s and MFU of each, `ratio` = tfbig / keras-hub.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import _timing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "gpt", ["gpt", "llama"], "The family on both sides.")
flags.DEFINE_string("preset", "small", "Preset (of --model) giving both models' dimensions.")
flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
flags.DEFINE_integer("seq_length", 256, "Tokens per sequence.")
flags.DEFINE_integer("steps", 6, "Timed steps per run (after the compiling first step).")
flags.DEFINE_integer("repeats", 2, "Rounds; each trains both once, the order alternating.")
flags.DEFINE_string("precision", "fp32", "fp32 | mixed_bfloat16 (both sides).")
flags.DEFINE_string("data_dir", "", "Prepared data (default: the embedded corpus, cached).")


def train_config(model_dir):
    from tfbig.config import ExperimentConfig

    cfg = ExperimentConfig()
    steps = 1 + FLAGS.steps
    for key, value in dict(
            model=FLAGS.model, preset=FLAGS.preset, batch_size=FLAGS.batch_size,
            seq_length=FLAGS.seq_length,
            data_dir=FLAGS.data_dir, model_dir=model_dir, max_steps=steps, log_every=steps,
            warmup_steps=1, eval_steps=1, checkpoint_every=10 ** 9, sample_tokens=0,
            precision=FLAGS.precision, xla=True, dropout=0.0).items():
        setattr(cfg.train, key, value)
    cfg.profile.monitor_interval_ms = 0  # keras-hub runs without one; keep the sides equal
    return cfg


def run_tfbig(model_dir):
    from tfbig.training.trainer import Trainer

    trainer = Trainer(train_config(model_dir))
    marks = _timing.clock_steps(trainer)
    trainer.fit()
    return {**_timing.rates(marks, FLAGS.batch_size * trainer.task.seq_length),
            "params": trainer.model.count_params(),
            "flops_per_token": trainer.task.flops_per_token()}


def run_keras_hub(model_dir):
    import keras
    import keras_hub
    import tensorflow as tf

    from tfbig import data
    from tfbig.optim import build_optimizer
    from tfbig.tasks import get_task
    from tfbig.training.precision import set_precision

    cfg = train_config(model_dir)
    set_precision(cfg.train.precision)
    keras.utils.set_random_seed(cfg.train.seed)
    task = get_task(cfg.train, cfg)  # resolves the data and the model dimensions as tfbig does
    mc = task.model_config
    if FLAGS.model == "llama":
        if (mc.rope_scaling != "none" or mc.qk_norm
                or mc.head_size * mc.num_heads != mc.hidden_size):
            raise SystemExit(f"--preset={FLAGS.preset}: RoPE scaling, QK-norm or a head width "
                             f"other than hidden / heads, which keras-hub's LlamaBackbone does "
                             f"not build here; the comparison would be void")
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=mc.vocab_size, num_layers=mc.num_layers,
            num_query_heads=mc.num_heads, hidden_dim=mc.hidden_size,
            intermediate_dim=mc.intermediate_size, num_key_value_heads=mc.num_kv_heads,
            rope_max_wavelength=mc.rope_theta, layer_norm_epsilon=mc.rms_norm_epsilon,
            dropout=mc.dropout, tie_word_embeddings=mc.tie_embeddings)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=mc.vocab_size, num_layers=mc.num_layers, num_heads=mc.num_heads,
            hidden_dim=mc.hidden_size, intermediate_dim=mc.intermediate_size,
            dropout=mc.dropout, max_sequence_length=mc.seq_length)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=build_optimizer(cfg.train, model.trainable_variables),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[], jit_compile=True)
    seq = task.seq_length

    def to_keras(batch):
        ids = batch["input_ids"]
        inputs = {"token_ids": ids[:, :-1], "padding_mask": tf.ones_like(ids[:, :-1])}
        return inputs, ids[:, 1:]

    dataset = data.make_dataset(task.data_dir, "train", cfg.train.batch_size, seq_length=seq,
                                vocab_size=mc.vocab_size, seed=cfg.train.seed).map(to_keras)
    class Clock(keras.callbacks.Callback):  # the clock read at the end of every step
        marks = []

        def on_train_batch_end(self, batch, logs=None):
            self.marks.append(_timing.clock())

    clock = Clock()
    model.fit(dataset, epochs=1, steps_per_epoch=1 + FLAGS.steps, callbacks=[clock], verbose=0)
    return {**_timing.rates(clock.marks, cfg.train.batch_size * seq), "params": model.count_params()}


def main(argv):
    del argv
    sides = {"tfbig": run_tfbig, "keras_hub": run_keras_hub}
    rounds, peak, peak_cpu = {name: [] for name in sides}, 0.0, 0.0
    with tempfile.TemporaryDirectory() as root:
        for index in range(FLAGS.repeats):
            order = list(sides) if index % 2 == 0 else list(sides)[::-1]
            for name in order:
                wall, cpu = _timing.peak_flops(FLAGS.precision)
                peak, peak_cpu = max(peak, wall), max(peak_cpu, cpu or 0.0)
                result = sides[name](os.path.join(root, f"{name}-{index}"))
                rounds[name].append(result)
                print(f"round {index} {name}: {result['tokens_per_sec']:,.0f} tok/s, "
                      f"{result['tokens_per_cpu_sec']:,.0f} tok/CPU-s "
                      f"({result['params']:,} params)", flush=True)
    params = {name: runs[0]["params"] for name, runs in rounds.items()}
    if params["tfbig"] != params["keras_hub"]:
        raise SystemExit(f"the two models differ in size: {params}; the comparison is void")
    flops = rounds["tfbig"][0]["flops_per_token"]  # the same architecture on both sides
    best = {name: max(r["tokens_per_sec"] for r in runs) for name, runs in rounds.items()}
    best_cpu = {name: max(r["tokens_per_cpu_sec"] for r in runs)
                for name, runs in rounds.items()}
    result = {"model": FLAGS.model, "preset": FLAGS.preset, "batch_size": FLAGS.batch_size,
              "seq_length": FLAGS.seq_length, "precision": FLAGS.precision, "xla": True,
              "timed_steps": FLAGS.steps, "repeats": FLAGS.repeats, "params": params["tfbig"],
              "peak_flops": round(peak),
              "tfbig_tokens_per_sec": round(best["tfbig"], 1),
              "keras_hub_tokens_per_sec": round(best["keras_hub"], 1),
              "tfbig_mfu": round(flops * best["tfbig"] / peak, 4),
              "keras_hub_mfu": round(flops * best["keras_hub"] / peak, 4),
              "rounds_tokens_per_sec": {n: [round(r["tokens_per_sec"], 1) for r in runs]
                                        for n, runs in rounds.items()},
              "tfbig_tokens_per_cpu_sec": round(best_cpu["tfbig"], 1),
              "keras_hub_tokens_per_cpu_sec": round(best_cpu["keras_hub"], 1),
              "peak_flops_per_cpu_sec": round(peak_cpu),
              **{f"{n}_mfu_cpu_time": round(flops * best_cpu[n] / peak_cpu, 4) if peak_cpu
                 else None for n in sides},
              "ratio_cpu": round(best_cpu["tfbig"] / best_cpu["keras_hub"], 3),
              "ratio": round(best["tfbig"] / best["keras_hub"], 3)}
    _record.emit(result)


if __name__ == "__main__":
    app.run(main)
