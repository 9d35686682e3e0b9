"""--model=llama under --strategy=horovod: a real `horovodrun -np 2 --gloo` launch against one
process reading, per step, exactly the examples both ranks read together (test_horovod's
reference): losses over 4 steps at rtol 1e-5, final weights by tests/equality.py's rule, ranks
bit-identical. Slow: one launch takes about a minute on 2 cores."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import (EQUIVALENCE, horovod_cfg, launch, listed, run_entry,  # noqa: E402
                          shared_reference)
from test_trainer import weights  # noqa: E402

LLAMA = dict(model="llama")


@pytest.fixture(scope="module")
def llama_runs(gpt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("horovod_llama")
    return launch(root, [run_entry("llama", horovod_cfg(gpt_data, root / "llama", **LLAMA),
                                   root / "out")])


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_equal_one_process_on_the_same_data(llama_runs, shared, tmp_path_factory,
                                                      gpt_data):
    first, second = llama_runs["llama"]
    keys = [k for k in first if k[0] in "wo" and k[1:].isdigit()]
    assert len(keys) > 20
    for key in keys:  # the ranks hold the same model and optimizer state
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)

    single, losses = shared_reference(shared, tmp_path_factory, gpt_data, **LLAMA)
    assert type(single.model).__name__ == "Llama"
    assert np.all(first["grad_norms"] > EQUIVALENCE["grad_clip_norm"])  # clipping is active
    assert len(losses) == len(first["losses"]) == EQUIVALENCE["max_steps"]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    assert len(weights(single)) == len(listed(first, "w"))
    for path, ours in zip(single.recorded.paths, listed(first, "w")):
        single.recorded.assert_equal_piece(path, ours, err_msg=path)
    assert float(first["eval_loss"]) == pytest.approx(single.evaluate()["loss"], rel=1e-5)
