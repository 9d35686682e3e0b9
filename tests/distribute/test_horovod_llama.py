"""--model=llama under --strategy=horovod: one real `horovodrun -np 2 --gloo` launch of plain
data parallelism, ZeRO-2 over both ranks and --activation_checkpointing with 2 accumulated
micro-batches, each against one process reading, per step, exactly the examples both ranks read
together (test_horovod's reference): losses over 4 steps at rtol 1e-5, final weights by
tests/equality.py's rule, ranks bit-identical. Slow: the launch takes 1-2 minutes on 2 cores."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import (EQUIVALENCE, horovod_cfg, launch, listed,  # noqa: E402
                          recompute_cfg, run_entry, shared_reference)
from test_trainer import weights  # noqa: E402

LLAMA = dict(model="llama")


# name: train options of the run and of its single-process reference
SCENARIOS = {"llama": {}, "llama_zero2": {}, "llama_recompute": {"grad_accum_steps": 2}}
BF16 = {"precision": "mixed_bfloat16"}  # the llama_bf16 run's and its reference's


def zero2(cfg):
    cfg.parallel.zero_stage, cfg.parallel.shard_degree = 2, 2
    return cfg


@pytest.fixture(scope="module")
def llama_runs(gpt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("horovod_llama")

    def cfg(name):
        return horovod_cfg(gpt_data, root / name, **LLAMA, **SCENARIOS[name])

    return launch(root, [run_entry("llama", cfg("llama"), root / "out"),
                         run_entry("llama_zero2", zero2(cfg("llama_zero2")), root / "out"),
                         run_entry("llama_recompute", recompute_cfg(cfg("llama_recompute")),
                                   root / "out"),
                         run_entry("llama_bf16", horovod_cfg(gpt_data, root / "llama_bf16",
                                                             **LLAMA, **BF16), root / "out")],
                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_two_ranks_equal_one_process_on_the_same_data(llama_runs, shared, tmp_path_factory,
                                                      gpt_data, name):
    first, second = llama_runs[name]
    kinds = "w" if name == "llama_zero2" else "wo"  # ZeRO: each rank holds its optimizer slice
    keys = [k for k in first if k[0] in kinds and k[1:].isdigit()]
    assert len(keys) >= 20
    for key in keys:  # the ranks hold the same model (and optimizer state)
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)

    single, losses = shared_reference(shared, tmp_path_factory, gpt_data, **LLAMA,
                                      **SCENARIOS[name])
    assert type(single.model).__name__ == "Llama"
    assert np.all(first["grad_norms"] > EQUIVALENCE["grad_clip_norm"])  # clipping is active
    assert len(losses) == len(first["losses"]) == EQUIVALENCE["max_steps"]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    assert len(weights(single)) == len(listed(first, "w"))
    for path, ours in zip(single.recorded.paths, listed(first, "w")):
        single.recorded.assert_equal_piece(path, ours, err_msg=path)
    assert float(first["eval_loss"]) == pytest.approx(single.evaluate()["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_bfloat16_ranks_equal_one_bfloat16_process(llama_runs, shared, tmp_path_factory,
                                                       gpt_data):
    """--precision=mixed_bfloat16 (bfloat16 matmuls, float32 weights, gradients averaged in
    float32): the ranks hold the same model, and the run equals one bfloat16 process on the
    same global batch within bfloat16's rounding: each step's loss at rtol 1e-3 (fp32 runs:
    1e-5), and 99% of each weight's entries within a quarter of a learning rate of the
    reference's after 4 steps (Adam moves an entry about one learning rate a step wherever
    its gradient is steady; where a gradient is near zero its sign may differ)."""
    first, second = llama_runs["llama_bf16"]
    keys = [k for k in first if k[0] in "wo" and k[1:].isdigit()]
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    single, losses = shared_reference(shared, tmp_path_factory, gpt_data, **LLAMA, **BF16)
    assert single.model.compute_dtype == "bfloat16"
    assert np.all(first["grad_norms"] > EQUIVALENCE["grad_clip_norm"])  # clipping is active
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-3)
    bound = 0.25 * single.cfg.train.learning_rate
    within = {v.path: np.mean(np.abs(ours - v.numpy()) <= bound)
              for v, ours in zip(single.model.trainable_variables, listed(first, "w"),
                                 strict=True)}
    assert min(within.values()) >= 0.99, within
