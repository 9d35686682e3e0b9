"""The planner's Llama family: parameters, FLOPs and variables equal the built model's, the
predicted memory of a training step within 10% of the bytes measured on this machine (GQA's
narrower K/V, SwiGLU's three matrices, RMSNorm), and `tfbig-plan --model=llama
--preset=llama-8b` planning only the layouts tfbig-train runs for the family (tensor
parallelism over divisors of the key/value heads, or multiples of them with the key/value
projections replicated and no sequence parallelism)."""
import keras
import pytest

from tfbig.models.llama import Llama, LlamaConfig
from tfbig.commands import plan as cli
from tfbig.plan import estimate
from tfbig.models import shapes as models

from .memory_probe import CPU
from .test_plan import plan

# (LlamaConfig fields over the tiny preset, batch): MHA-free shapes, GQA and MQA
CASES = {"h128 gqa": (dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=344, seq_length=128, vocab_size=2048), 8),
         "h256 mqa": (dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=1,
                           intermediate_size=688, seq_length=256, vocab_size=1024), 16)}


def measure(config, batch):
    """(model state bytes, step peak bytes) of one fp32 graph training step of a Llama (the
    method of tfbig.training.measure.measure_step, with AdamW's slots)."""
    import tensorflow as tf

    from tfbig.config import TrainConfig
    from tfbig.optim import build_optimizer
    from tfbig.training.measure import allocator_peak

    net = Llama(config)
    net.build()
    optimizer = build_optimizer(TrainConfig(max_steps=10, warmup_steps=1),
                                net.trainable_variables)
    ids = tf.random.uniform((batch, config.seq_length + 1), 0, config.vocab_size, tf.int32)

    @tf.function(jit_compile=False)
    def step(batch):
        with tf.GradientTape() as tape:
            logits = net(batch[:, :-1], training=True)  # (B, T, V)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch[:, 1:], logits))
        optimizer.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)

    step(ids)  # traces and creates the optimizer slots
    state = sum(v.numpy().nbytes for v in net.variables + optimizer.variables)
    return state, allocator_peak(lambda: step(ids))


@pytest.mark.parametrize("name", ["h128 gqa", pytest.param("h256 mqa", marks=pytest.mark.slow)])
def test_predicted_memory_within_10_percent_of_measured(name):
    fields, batch = CASES[name]
    config = LlamaConfig.from_preset("tiny", **fields)
    shape = models.shape_of(config, "llama", config.seq_length)
    mem = estimate.memory(shape, estimate.Layout(), batch, "fp32", CPU)
    state, peak = measure(config, batch)
    planned_state = mem["parameters"] + mem["optimizer"]
    assert state == pytest.approx(planned_state, rel=0.10)
    planned_peak = planned_state + mem["gradients"] + mem["activations"]
    assert state + peak == pytest.approx(planned_peak, rel=0.10), (state + peak, planned_peak)


@pytest.mark.parametrize("overrides", [{}, dict(tie_embeddings=True),
                                       dict(attention_bias=True, num_kv_heads=4),
                                       dict(qk_norm=True, head_size=10)])
def test_shape_counts_equal_the_built_model(overrides):
    config = LlamaConfig.from_preset("tiny", **overrides)
    shape = models.shape_of(config, "llama", 64)
    keras.utils.set_random_seed(0)
    model = Llama(config)
    model.build()
    assert shape.params == model.count_params() == sum(s.params for s in shape.pipe_layers)
    assert shape.num_variables == len(model.trainable_variables)
    assert sum(s.flops_per_token for s in shape.pipe_layers) == config.flops_per_token(64)
    assert shape.kv_fraction == config.num_kv_heads / config.num_heads and shape.gated_mlp


def test_llama_8b_plan_counts_gqa_and_plans_what_tfbig_train_runs():
    values, _, estimates = plan(["--model=llama", "--preset=llama-8b", "--gpu=H100-80GB",
                                 "--gpus_per_node=8", "--nodes=1"])
    shape = cli.shape_from_flags(values)
    assert shape.params == 8_030_261_248 and shape.seq_length == 8192
    assert shape.kv_fraction == 8 / 32
    assert {e.layout.pipeline for e in estimates} > {1}
    assert {e.layout.tensor for e in estimates} == {1, 2, 4, 8}  # dividing the 8 KV heads
    # sequence parallelism with every tensor-parallel layout (tfbig-train runs Llama with it)
    assert {e.layout.sequence_parallel for e in estimates if e.layout.tensor > 1} >= {True}
    assert {e.layout.context for e in estimates} > {1}
    assert max(e.layout.zero_stage for e in estimates) == 3
    assert estimates[0].fits
    # GQA: K and V at a quarter of the query width, in the activations the plan keeps
    mha = models.Shape(**{**shape.__dict__, "kv_fraction": 1.0})
    assert estimate.split_layer_bytes(mha) - estimate.split_layer_bytes(shape) == 3 * 4096


def test_layouts_tfbig_train_cannot_run_for_llama_are_refused_by_name():
    with pytest.raises(ValueError, match=r"--tensor_parallel=12 does not divide the model's "
                                         r"num_heads=32, num_kv_heads=8; choose one of "
                                         r"\[1, 2, 4, 8, 16, 32\]"):
        plan(["--model=llama", "--preset=llama-8b", "--tensor_parallel=12",
              "--gpus_per_node=16"])
    with pytest.raises(ValueError, match="--sequence_parallel with --tensor_parallel=16 above "
                                         "the model's num_kv_heads=8"):
        plan(["--model=llama", "--preset=llama-8b", "--tensor_parallel=16",
              "--sequence_parallel", "--gpus_per_node=16"])


def test_more_tensor_ranks_than_key_value_heads_hold_them_whole():
    """--tensor_parallel=16 of Llama 3 8B (8 key/value heads): every rank keeps the whole key
    and value projections (as tfbig-train replicates them), the rest split 16 ways; no
    sequence parallelism is planned with it."""
    values, _, estimates = plan(["--model=llama", "--preset=llama-8b", "--tensor_parallel=16",
                                 "--gpus_per_node=16", "--nodes=1"])
    shape = cli.shape_from_flags(values)
    assert estimates and {e.layout.tensor for e in estimates} == {16}
    assert not any(e.layout.sequence_parallel for e in estimates)
    split = estimate.stage_params(shape, estimate.Layout(tensor=8))
    held = estimate.stage_params(shape, estimate.Layout(tensor=16))
    kv = 2 * 4096 * 1024 * 32  # K and V kernels (4096 x 8 heads of 128) of the 32 layers
    assert held == pytest.approx(split / 2 + kv * (1 - 1 / 16))

