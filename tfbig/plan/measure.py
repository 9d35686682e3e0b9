"""What one training step of a GPT holds and how fast it runs on this machine, beside the plan.

The step is the trainer's single-replica step: forward and backward of the next-token loss
(XLA-compiled or not) and the optimizer's apply (tfbig.optim: AdamW with its two slots). Held
bytes are read, not modelled: the model state is the bytes of the variables (weights and
optimizer slots), the step peak is the CPU allocator's peak during a step above what was
allocated before it (the least of 3 steps: the executor's thread interleaving moves it). This module imports TensorFlow; the rest of tfbig.plan does not.

Example:
    measure_step(dict(hidden_size=128, num_layers=2, num_heads=4, seq_length=128,
                      vocab_size=2048), batch_size=8)   # {"model_state": ..., "step_peak": ...}
"""
import time


def measure_step(model, batch_size, xla=True, steps=0):
    """Bytes held (model_state, step_peak) and, with `steps` > 0, tokens/s of a tiny-preset GPT
    with the `model` fields overridden."""
    import tensorflow as tf

    from tfbig.config import TrainConfig
    from tfbig.models.gpt import GPT, GPTConfig
    from tfbig.optim import build_optimizer

    config = GPTConfig.from_preset("tiny", **model)
    net = GPT(config)
    net.build()
    optimizer = build_optimizer(TrainConfig(max_steps=10, warmup_steps=1),
                                net.trainable_variables)
    ids = tf.random.uniform((batch_size, config.seq_length + 1), 0, config.vocab_size, tf.int32)

    @tf.function(jit_compile=xla)
    def forward_backward(batch):
        with tf.GradientTape() as tape:
            logits = net(batch[:, :-1], training=True)  # (B, T, V)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch[:, 1:], logits))
        return tape.gradient(loss, net.trainable_variables)

    @tf.function
    def step(batch):
        optimizer.apply(forward_backward(batch), net.trainable_variables)

    step(ids)  # compiles and creates the optimizer slots
    held = {"model_state": sum(v.numpy().nbytes for v in net.variables + optimizer.variables)}
    peaks = []
    for _ in range(5):  # the order independent ops run in moves the peak by up to ~15% here
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        step(ids)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    held["step_peak"] = min(peaks)  # what the step needs in its tightest observed order
    if steps:
        start = time.perf_counter()
        for _ in range(steps):
            step(ids)
        optimizer.iterations.numpy()  # waits for the last step
        held["tokens_per_sec"] = steps * batch_size * config.seq_length / (
            time.perf_counter() - start)
    return held
