"""ZeRO stages 1-2 with MiCS partition groups (`--zero_stage`, `--shard_degree`) through one real
`horovodrun -np 4 --gloo` launch, against the single-device run on the same global batch.

Scenarios (tests/distribute/horovod_worker.py plans; HOROVOD_DYNAMIC_PROCESS_SETS=1 lets one
process build several rank grids): stage 1 and 2 at shard degree 2 (2 partition groups of 2,
the 2-hop sync) and 4 (one group, plain ZeRO), with accumulation and clipping active, AdamW and
LAMB, ALBERT, a resume from the per-slice checkpoints, and an fp16 step made non-finite on one
rank only.
"""
import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import (ALBERT, WORKER, horovodrun, listed, load, read,  # noqa: E402
                          run_entry)
from test_trainer import ReplicasTask, make_cfg, weights  # noqa: E402

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig.config import ParallelConfig  # noqa: E402
from tfbig.distribute.horovod import build_mesh  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.trainer import Trainer  # noqa: E402

RANKS = 4
# Clipping at 0.5 is active at every step; 2 micro-batches of 2 sequences per rank.
TRAIN = dict(max_steps=4, batch_size=16, grad_clip_norm=0.5, dropout=0.0, grad_accum_steps=2)
LAMB = dict(optimizer="lamb", learning_rate=1e-2, weight_decay=0.01, epsilon=1e-6)
SCENARIOS = {  # name: (zero_stage, shard_degree, data, train options, worker options)
    "z1_d2": (1, 2, "gpt_data", {}, {}),
    "z2_d4_lamb": (2, 4, "gpt_data", LAMB, {}),
    "z2_d2_albert": (2, 2, "albert_data", ALBERT, {}),
    "z1_d4_resumed": (1, 4, "gpt_data", {}, {"interrupt_at": 2}),
    "z2_d2_fp16_skip": (2, 2, "gpt_data", {"precision": "mixed_float16"}, {"poison_rank": 3}),
}


def zero_cfg(data_dir, model_dir, stage, degree, **train):
    cfg = make_cfg(data_dir, model_dir, strategy="horovod", **{**TRAIN, **train})
    cfg.parallel.zero_stage, cfg.parallel.shard_degree = stage, degree
    return cfg


@pytest.fixture(scope="module")
def runs(gpt_data, albert_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    out = root / "out"
    data = {"gpt_data": gpt_data, "albert_data": albert_data}
    plan = [run_entry(name, zero_cfg(data[d], root / name, stage, degree, **train), out, **opts)
            for name, (stage, degree, d, train, opts) in SCENARIOS.items()]
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    command = ["-np", str(RANKS), "-H", f"localhost:{RANKS}"]
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt",
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, ranks=command)
    assert code == 0, read(root / "log.txt")[-6000:]
    return root, out


def reference(data_dir, model_dir, **train):
    """The single-device run on the examples the 4 ranks read together."""
    cfg = make_cfg(data_dir, model_dir, **{**TRAIN, **train})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    trainer = Trainer(cfg, task=ReplicasTask(cfg.train, RANKS, get_task(cfg.train, cfg)),
                      logger=logger)
    trainer.fit()
    return trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["z1_d2", "z2_d4_lamb", "z2_d2_albert", "z1_d4_resumed"])
def test_sharded_ranks_equal_one_process_on_the_same_data(runs, request, tmp_path, name):
    _, out = runs
    _, _, data, train, _ = SCENARIOS[name]
    ranks = [load(out, name, r) for r in range(RANKS)]
    single, losses = reference(request.getfixturevalue(data), tmp_path, **train)
    first = ranks[0]
    assert np.all(first["grad_norms"] > TRAIN["grad_clip_norm"])  # clipping is active
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    # the global norm is over all slices: it equals the single device's
    assert first["step"] == TRAIN["max_steps"]
    for ours, theirs in zip(listed(first, "w"), weights(single)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    for other in ranks[1:]:  # every rank gathers the same full parameters
        for a, b in zip(listed(first, "w"), listed(other, "w")):
            np.testing.assert_array_equal(a, b)
    if name == "z1_d4_resumed":
        assert int(first["restored_step"]) == 2


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["z1_d2", "z2_d4_lamb"])
def test_per_rank_model_state_is_the_closed_form(runs, name):
    _, out = runs
    degree = SCENARIOS[name][1]
    for r in range(RANKS):
        result = load(out, name, r)
        sizes = [w.size for w in listed(result, "w")]
        params = sum(sizes)
        slices = sum(math.ceil(n / degree) for n in sizes)  # each variable padded to N slices
        assert int(result["bytes_parameters"]) == 4 * params
        assert int(result["bytes_master_slices"]) == 4 * slices
        assert int(result["bytes_optimizer_slots"]) == 8 * slices  # m and v of this slice
        assert slices * degree < params + degree * len(sizes)  # padding < one element a slice


@pytest.mark.multiproc
def test_slice_checkpoints_are_written_by_their_owners(runs):
    root, _ = runs
    model_dir = root / "z1_d4_resumed"
    assert json.loads((model_dir / "zero.json").read_text()) == {
        "zero_stage": 1, "shard_degree": 4, "data": 4, "world_size": 4}
    for j in range(1, 4):
        assert (model_dir / "zero" / f"shard-{j}" / "checkpoint").exists()
    # degree 2: the second partition group (ranks 2, 3) is a replica and writes nothing
    assert sorted(p.name for p in (root / "z1_d2" / "zero").iterdir()) == ["shard-1"]


@pytest.mark.multiproc
def test_a_non_finite_slice_on_one_rank_skips_the_step_on_all(runs):
    _, out = runs
    ranks = [load(out, "z2_d2_fp16_skip", r) for r in range(RANKS)]
    for result in ranks:
        assert int(result["nonfinite_steps"]) == 1
        assert float(result["scale_after_poison"]) == float(ranks[0]["scale_after_poison"])
        for before, after in zip(listed(result, "initial"), listed(result, "after_poison")):
            np.testing.assert_array_equal(before, after)  # the poisoned step changed nothing
    for a, b in zip(listed(ranks[0], "w"), listed(ranks[3], "w")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("options, world, message", [
    (dict(zero_stage=5), 4, "--zero_stage=5: expected 0 (no sharding), 1"),
    (dict(zero_stage=3), 4, "--zero_stage=3 is not supported by --strategy=horovod yet"),
    (dict(zero_stage=1, shard_degree=3), 4, "--shard_degree=3 does not divide the 4"),
    (dict(shard_degree=2), 4, "--shard_degree=2 needs --zero_stage=1, 2 or 3"),
])
def test_bad_sharding_flags_are_refused_before_training(options, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_mesh(ParallelConfig(**options), world)
