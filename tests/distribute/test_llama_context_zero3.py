"""--model=llama under --context_parallel and --zero_stage=3 through real `horovodrun -np 2
--gloo` launches, against one process on the same global batch (test_tensor_parallel's
reference and recording worker): losses over 4 steps at rtol 1e-5, final weights by
tests/equality.py's rule, first-step gradients, with clipping active and 2 accumulated
micro-batches.

Tiny Llama: hidden 32, 2 layers, 4 query / 2 key-value heads, sequence 16. Context parallel:
each rank holds chunks i and 3-i of 4 (token ids, RoPE at those positions, its own tokens'
loss) and attends over the key/value heads gathered from both. ZeRO-3: each block, the final
norm, the head and the word table gathered around their calls (a tied table once per step).
All slow: CP2, ZeRO-3, and both with the tied table (preset small).
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import WORKER, horovodrun, listed, load, read, run_entry  # noqa: E402
from test_tensor_parallel import TRAIN, shared_reference  # noqa: E402
from test_trainer import make_cfg  # noqa: E402

LLAMA = dict(model="llama")
TIED = dict(preset="small")  # tie_embeddings, at make_cfg's tiny sizes
# name: (parallel, train options). All slow: the default run's Llama CP2 starts from a
# checkpoint (test_init_split's cp2: losses, final weights, gradients); here from a fresh
# initialisation, with the tied table too.
SCENARIOS = {}
SLOW_SCENARIOS = {
    "llama_cp2": (dict(context_parallel=2), {}),
    "llama_zero3": (dict(zero_stage=3, shard_degree=2), {}),
    "llama_zero3_tied": (dict(zero_stage=3, shard_degree=2), TIED),
    "llama_cp2_tied": (dict(context_parallel=2), TIED),
}
RANKS = 2


def llama_cfg(data_dir, model_dir, parallel, **train):
    cfg = make_cfg(data_dir, model_dir, strategy="horovod", **{**TRAIN, **LLAMA, **train})
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    return cfg


def launch(root, scenarios, data_dir):
    out = root / "out"
    plan = [run_entry(name, llama_cfg(data_dir, root / name, parallel, **train), out,
                      first_gradients=True) for name, (parallel, train) in scenarios.items()]
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt", timeout=1800,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert code == 0, read(root / "log.txt")[-6000:]
    return root, out


@pytest.fixture(scope="module")
def runs(gpt_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("llama_cp"), SCENARIOS, gpt_data)


@pytest.fixture(scope="module")
def slow_runs(gpt_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("llama_cp_zero3"), SLOW_SCENARIOS, gpt_data)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SCENARIOS) + [
    pytest.param(name, marks=pytest.mark.slow) for name in SLOW_SCENARIOS])
def test_llama_context_parallel_and_zero3_equal_one_process(request, gpt_data, shared,
                                                            tmp_path_factory, name):
    slow = name in SLOW_SCENARIOS
    root, out = request.getfixturevalue("slow_runs" if slow else "runs")
    parallel, train = (SLOW_SCENARIOS if slow else SCENARIOS)[name]
    replicas = RANKS // parallel.get("context_parallel", 1)
    first, second = [load(out, name, r) for r in range(RANKS)]
    single, losses, grads = shared_reference(shared, tmp_path_factory, gpt_data, replicas,
                                             **LLAMA, **train)
    assert type(single.model).__name__ == "Llama"
    assert single.model.config.num_kv_heads == 2 and single.model.config.num_heads == 4
    assert single.model.config.tie_embeddings == (train == TIED)
    assert np.all(first["grad_norms"] > TRAIN["grad_clip_norm"])  # clipping is active
    assert len(first["losses"]) == len(losses) == TRAIN["max_steps"]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    single.recorded.assert_equal(listed(first, "w"), err_msg=name)
    assert len(listed(first, "gradients")) == len(grads) > 10
    for ours, theirs in zip(listed(first, "gradients"), grads):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    for a, b in zip(listed(first, "w"), listed(second, "w")):  # both ranks: the same model
        np.testing.assert_array_equal(a, b)
    assert float(first["eval_loss"]) == pytest.approx(single.summary["eval"]["loss"], rel=1e-5)
    if "context_parallel" in parallel:
        log = read(root / "log.txt")
        assert "context rank i holds chunks i and 3-i: rank 0 positions 0..3 and 12..15" in log
