"""A user's own training script in the style of the Horovod TF2 examples (own GradientTape loop,
hvd.init, broadcast after the first step, rank-0 checkpoints), on a tfbig GPT with Keras 3.

The two Horovod calls that fail on Keras 3 (`hvd.DistributedGradientTape`,
`hvd.broadcast_variables(model.variables)`) are replaced by tfbig.distribute.horovod_keras.
Each rank seeds its model differently, so only the broadcast can make them equal.

    horovodrun -np 2 -H localhost:2 --gloo python horovod_post_style.py DATA_DIR MODEL_DIR OUT_DIR

Writes OUT_DIR/post.rank{R}.npz: initial and final weights, losses.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfbig import data  # noqa: E402
from tfbig.distribute import horovod_keras as hk  # noqa: E402
from tfbig.data import load_manifest  # noqa: E402
from tfbig.models.gpt import GPT, GPTConfig  # noqa: E402

STEPS, BATCH_PER_RANK, SEQ = 6, 4, 16


def main(data_dir, model_dir, out_dir):
    # Horovod: initialise and pin one GPU per process.
    hk.init()
    keras.utils.set_random_seed(hvd.rank())  # different initial weights on purpose
    vocab = load_manifest(data_dir).vocab_size
    model = GPT(GPTConfig(vocab_size=vocab, seq_length=SEQ, num_layers=2, hidden_size=32,
                          num_heads=4, dropout=0.0))
    model.build((None, SEQ))
    # Horovod: scale the learning rate by the number of processes.
    optimizer = keras.optimizers.Adam(1e-3 * hvd.size())
    # Horovod: each process reads its own shard of the data.
    context = tf.distribute.InputContext(hvd.size(), hvd.rank(), hvd.size())
    dataset = data.make_dataset(data_dir, "train", BATCH_PER_RANK, seq_length=SEQ,
                                input_context=context, deterministic=True)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    initial = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def training_step(batch, first_batch):
        with tf.GradientTape() as tape:
            logits = model(batch["input_ids"][:, :-1], training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch["input_ids"][:, 1:], logits))
        # Horovod: average the gradients (instead of hvd.DistributedGradientTape).
        grads = hk.average_gradients(tape.gradient(loss, model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: broadcast model and optimizer state after the first step, when the
        # optimizer's slots exist (instead of hvd.broadcast_variables(model.variables)).
        if first_batch:
            hk.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
        return hk.average_values(loss)

    losses = []
    for step, batch in enumerate(dataset.take(STEPS)):
        losses.append(float(training_step(batch, step == 0)))
        if hvd.rank() == 0:  # Horovod: only rank 0 prints and saves
            print(f"step {step + 1} loss {losses[-1]:.4f}", flush=True)
    if hvd.rank() == 0:
        checkpoint.save(os.path.join(model_dir, "ckpt"))
    arrays = {f"initial{i}": w for i, w in enumerate(initial)}
    arrays.update({f"w{i}": v.numpy() for i, v in enumerate(model.trainable_variables)})
    arrays.update({f"o{i}": np.asarray(v.numpy()) for i, v in enumerate(optimizer.variables)})
    np.savez(os.path.join(out_dir, f"post.rank{hvd.rank()}.npz"), losses=np.array(losses),
             **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:4])
