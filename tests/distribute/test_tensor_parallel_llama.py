"""--model=llama under --tensor_parallel through real `horovodrun --gloo` launches, against one
process on the same global batch (test_tensor_parallel's reference and recording worker).

Tiny Llama: hidden 32, 2 layers, 4 query / 2 key-value heads (grouped-query attention: each
tensor rank holds 2 query heads and the 1 key/value head they read), SwiGLU width 256, untied
head; clipping active, 2 accumulated micro-batches. Slow (the default run's Llama TP2 starts
from a checkpoint: tests/distribute/test_init_split.py): TP2 on 2 ranks (losses over 4 steps at
rtol 1e-5, final weights by tests/equality.py's rule, first-step gradients assembled from the
slices), TP2 x DP2 on 4 ranks, alone and with ZeRO-1 and ZeRO-3, and TP2 with
the tied word table, alone and with --sequence_parallel (each RMSNorm and the residual stream
on the rank's half of the positions, gathered into the split regions and reduce-scattered out).
In-process: each rank's slice of the single-device initialisation, and the refusals.
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import listed, load, read, run_entry, run_plan  # noqa: E402
from test_tensor_parallel import TRAIN, shared_reference, tp_cfg  # noqa: E402

from tfbig.layouts.tensor_layout import split_model, take_slice  # noqa: E402
from tfbig.layouts.tensor_plan import TensorGroup  # noqa: E402

LLAMA = dict(model="llama")
# name: (ranks, tensor_parallel, train options), all slow: the default run's Llama TP2 starts
# from a checkpoint (tests/distribute/test_init_split.py: losses, final weights, gradients)
SLOW_SCENARIOS = {"llama_tp2": (2, 2, {}),
                  "llama_tp2_dp2": (4, 2, {}),
                  # each tensor rank's optimizer slots (ZeRO-1) or its whole state (ZeRO-3)
                  # sharded over its 2 data ranks
                  "llama_tp2_dp2_zero1": (4, 2, {"zero_stage": 1}),
                  "llama_tp2_dp2_zero3": (4, 2, {"zero_stage": 3}),
                  "llama_tp2_tied": (2, 2, {"preset": "small"}),  # small: a tied table
                  # each norm on the rank's half of the positions, the tied table too
                  "llama_tp2_sequence": (2, 2, {"sequence_parallel": True, "preset": "small"})}


def launch(root, scenarios, ranks, data_dir):
    """One `horovodrun -np ranks` running `scenarios`; returns the results' folder."""
    out = root / "out"
    plan = [run_entry(name, tp_cfg(data_dir, root / name, tensor, **LLAMA, **train), out,
                      first_gradients=True)
            for name, (_, tensor, train) in scenarios.items()]
    os.makedirs(out)
    run_plan(root, plan, ranks)
    return out


@pytest.fixture(scope="module")
def slow_runs(gpt_data, tmp_path_factory):
    out = {}
    for ranks in (4, 2):  # one launch per world size
        group = {n: s for n, s in SLOW_SCENARIOS.items() if s[0] == ranks}
        out[ranks] = launch(tmp_path_factory.mktemp(f"tp_llama_{ranks}"), group, ranks,
                            gpt_data)
    return out


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_SCENARIOS))
def test_llama_tensor_parallel_equals_one_process(slow_runs, gpt_data, shared, tmp_path_factory,
                                                  name):
    ranks, tensor, train = SLOW_SCENARIOS[name]
    results = slow_runs[ranks]
    per_rank = [load(results, name, r) for r in range(ranks)]
    single, losses, grads = shared_reference(shared, tmp_path_factory, gpt_data,
                                             ranks // tensor, **LLAMA, **train)
    assert type(single.model).__name__ == "Llama"
    assert single.model.config.num_kv_heads == 2 and single.model.config.num_heads == 4
    first = per_rank[0]
    assert np.all(first["grad_norms"] > TRAIN["grad_clip_norm"])  # clipping is active
    assert len(first["losses"]) == len(losses) == TRAIN["max_steps"]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    single.recorded.assert_equal(listed(first, "w"), err_msg=name)
    assert len(listed(first, "gradients")) == len(grads) > 10
    for ours, theirs in zip(listed(first, "gradients"), grads):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    if train.get("sequence_parallel"):  # the run split its norms' positions over the group
        assert ("sequence parallel: their activations split along the sequence, positions "
                f"t*T/{tensor}.. on tensor rank t") in read(results.parent / "log.txt")
    for other in per_rank[1:]:  # every rank's group assembles the same model
        for a, b in zip(listed(first, "w"), listed(other, "w")):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class _Task:
    """A tiny Llama to split, without data."""

    def __init__(self, seq_length=16, **config):
        from tfbig.models.llama import LlamaConfig

        self.seq_length = seq_length
        self.config = LlamaConfig.from_preset("tiny", **{
            "vocab_size": 320, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
            "intermediate_size": 96, **config})

    def build_model(self):
        from tfbig.models.llama import Llama

        model = Llama(self.config, name="llama")
        model.build((None, self.seq_length))
        return model


@pytest.mark.parametrize("tied", [False, True])
def test_a_llama_rank_holds_its_heads_and_columns_of_the_single_device_model(tied):
    import keras

    task = _Task(tie_embeddings=tied)
    keras.utils.set_random_seed(0)
    reference = {v.path: v.numpy() for v in task.build_model().variables}
    keras.utils.set_random_seed(0)
    local, splits = split_model(task, TensorGroup(None, 1, 2))
    attn = local.blocks[0].attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_size) == (2, 1, 8)
    shapes = {v.path: tuple(v.shape) for v in local.variables}
    assert shapes["llama/block_0/attn/query/kernel"] == (32, 16)  # 2 query heads of 8
    assert shapes["llama/block_0/attn/key/kernel"] == (32, 8)  # the 1 key/value head they read
    assert shapes["llama/block_0/attn/value/kernel"] == (32, 8)
    assert shapes["llama/block_0/attn/proj/kernel"] == (16, 32)
    assert shapes["llama/block_1/mlp/gate/kernel"] == (32, 48)
    assert shapes["llama/block_1/mlp/down/kernel"] == (48, 32)
    assert shapes["llama/embedding/embeddings"] == (160, 32)
    assert ("llama/head/kernel" in shapes) != tied
    if not tied:
        assert shapes["llama/head/kernel"] == (32, 160)
    # replicated: the RMSNorm scales only
    assert {p.rsplit("/", 2)[-2] for p in shapes if p not in splits
            and "seed_generator" not in p} == {"attn_norm", "mlp_norm", "final_norm"}
    for v in local.variables:
        if "seed_generator" in v.path:
            continue
        expected = reference[v.path]
        if v.path in splits:
            expected = take_slice(expected, *splits[v.path], 1, 2)
        np.testing.assert_array_equal(v.numpy(), expected)


def test_more_tensor_ranks_than_key_value_heads_hold_them_whole():
    """8 query / 2 key-value heads over 4 tensor ranks: each rank keeps 2 query heads and the
    whole key and value projections (not split: no entry in the splits), and its wrapped
    projection gives the columns of the one head its queries read (rank 3: head 1)."""
    import keras

    from tfbig.distribute.tensor_layers import wrap
    from tfbig.models.layout import Split

    task = _Task(num_heads=8, num_kv_heads=2)
    keras.utils.set_random_seed(0)
    reference = {v.path: v.numpy() for v in task.build_model().variables}
    keras.utils.set_random_seed(0)
    group = TensorGroup(None, 3, 4)
    local, splits = split_model(task, group)
    attn = local.blocks[0].attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert attn.query.kernel.shape == (32, 8) and attn.key.kernel.shape == (32, 8)
    assert attn.key.kernel.path not in splits and attn.value.kernel.path not in splits
    np.testing.assert_array_equal(attn.key.kernel.numpy(), reference[attn.key.kernel.path])
    wrap(attn.key, Split("shared_column"), group)  # the backend's wrap of this entry
    x = np.random.default_rng(0).standard_normal((1, 3, 32)).astype("float32")
    np.testing.assert_allclose(attn.key(x).numpy(), x @ reference[attn.key.kernel.path][:, 4:],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config, size, sequence, message", [
    (dict(hidden_size=48, num_heads=6, num_kv_heads=2), 4, False,
     r"--tensor_parallel=4 neither divides num_kv_heads=2 nor is a multiple of it dividing "
     r"num_heads=6"),
    (dict(num_heads=4, num_kv_heads=1), 2, True,
     r"--sequence_parallel with --tensor_parallel=2 above the key/value heads"),
    (dict(seq_length=15), 2, True, "--sequence_parallel with --tensor_parallel=2: the "
     "sequence length 15 must be a multiple of 2"),
])
def test_llama_layouts_that_do_not_split_are_refused_by_name(config, size, sequence, message):
    with pytest.raises(ValueError, match=message):
        split_model(_Task(**config), TensorGroup(None, 0, size, sequence))
