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
                                   root / "out")],
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
