"""A user's Keras model with tfbig's SparseMoE layers (examples/own_moe.py: nothing declared,
the layers found by type): on one process it learns the counting sequences with the
load-balancing loss in its loss; under --expert_parallel=2 on a real `horovodrun -np 2 --gloo`
launch (each rank holding 2 of the 4 experts of every block, tokens sent to them by
all-to-all, 2 data-parallel replicas) it equals one process on the same global batches: the
losses of 4 steps (rtol 1e-5), every weight's first-step gradient and final value
(tests/equality.py's rule), the expert weights gathered whole from the ranks. Each replica's
load-balancing loss is its own micro-batch's (a product of batch means, as in tfbig's MoE
Llama), so the one process routes each replica's rows apart (ReplicaRows) and averages. A model
without any MoE layer is refused by name under --expert_parallel."""
import json
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from equality import GRADIENT_ATOL, GRADIENT_RTOL  # noqa: E402
from test_horovod import horovodrun, read  # noqa: E402
from user_moe_worker import own_moe, train  # noqa: E402

WORKER = os.path.join(HERE, "user_moe_worker.py")
STEPS = dict(max_steps=4, batch_size=8, learning_rate=3e-3, warmup_steps=1, xla=False,
             peak_tflops=1.0, log_every=1, eval_steps=0, grad_clip_norm=0.5)


class ReplicaRows(own_moe.MoEModel):
    """MoEModel routing each of 2 data-parallel replicas' rows apart (every second row of the
    global batch: examples/own_model.py's dataset_fn shards the stream so): its logits in the
    batch's order, both replicas' routing statistics (the task averages their load-balancing
    losses, as the two ranks' losses are averaged)."""

    def call(self, inputs):
        halves = [super(ReplicaRows, self).call(inputs[r::2]) for r in range(2)]
        logits = tf.stack([h["logits"] for h in halves], axis=1)  # (B/2, 2, T, V)
        return {"logits": tf.reshape(logits, (-1, *logits.shape[2:])),
                "routing": halves[0]["routing"] + halves[1]["routing"]}


class ReplicaRowsTask(own_moe.MoETask):
    def build_model(self):
        model = ReplicaRows(**own_moe.SIZE, name="mo_e_model")
        model(tf.zeros((2, own_moe.SIZE["maxlen"]), tf.int32))
        return model


def test_a_user_moe_model_learns_with_its_load_balancing_loss(tmp_path, capsys):
    import tfbig

    run = tfbig.train(own_moe.MoETask(), model_dir=str(tmp_path / "run"),
                      **{**STEPS, "max_steps": 40, "log_every": 10, "eval_steps": 1})
    losses = run.losses
    run.close()
    # ln(32) = 3.47 at random; the aux loss adds 0.01 x (1 when balanced) to each
    assert losses[0] > 3.0 and losses[-1] < 2.5, losses
    assert run.trainer.model.blocks[0].moe.num_experts == 4
    # the task's routing_metrics on the progress line: 8 rows x 16 tokens, 2 experts each,
    # over 4 experts: 64 a expert on average, min <= 64 <= max (dropless: nothing dropped)
    loads = re.findall(r"expert tokens (\d+)/([\d.]+)/(\d+) \(min/mean/max\)",
                       capsys.readouterr().out)
    assert len(loads) == 4, loads  # steps 10, 20, 30, 40
    for low, mean, high in loads:
        assert float(mean) == 64.0 and int(low) <= 64 <= int(high), loads


@pytest.mark.slow  # one launch, ~40 s; EP of tfbig's own MoE Llama is in the default run
@pytest.mark.multiproc
def test_a_user_moe_model_under_expert_parallelism_equals_one_process(tmp_path):
    flags = {**STEPS, "strategy": "horovod", "expert_parallel": 2}
    (tmp_path / "run.json").write_text(json.dumps({"flags": flags,
                                                   "model_dir": str(tmp_path / "ep2")}))
    code = horovodrun([WORKER, str(tmp_path / "run.json")], tmp_path / "log.txt")
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    assert "expert parallel: each expert group of 2 ranks" in read(tmp_path / "log.txt")
    paths = json.loads((tmp_path / "ep2" / "paths.json").read_text())
    ours = dict(np.load(tmp_path / "ep2" / "result.npz"))
    assert int(ours["replicas"]) == 2
    one = {k: v for k, v in flags.items() if k not in ("strategy", "expert_parallel")}
    trainer, recorded = train(str(tmp_path / "one"), one, ReplicaRowsTask())
    assert recorded.paths == paths and len(paths) > 20
    np.testing.assert_allclose(ours["losses"], trainer.logger.losses, rtol=1e-5)
    assert len(ours["losses"]) == 4 and ours["losses"][0] != ours["losses"][-1]
    experts = [p for p in paths if "/experts/" in p]
    assert len(experts) == 2 * 3  # gate, up and down of each block's bank, whole
    for i, (path, theirs) in enumerate(zip(paths, recorded.gradients()[0])):
        assert ours[f"gradient{i}"].shape == theirs.shape, path
        np.testing.assert_allclose(ours[f"gradient{i}"], theirs, rtol=GRADIENT_RTOL,
                                   atol=GRADIENT_ATOL, err_msg=path)
    recorded.assert_equal({p: ours[f"weight{i}"] for i, p in enumerate(paths)})


def test_expert_parallelism_of_a_model_without_moe_layers_is_refused_by_name(tmp_path):
    """The refusal names the flag and what is missing before any training (one process: the
    data axis of 1 rank cannot hold 2 expert ranks either, so the strategy is built alone)."""
    from tfbig.distribute.expert_parallel import moe_layers

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
    import own_model

    with pytest.raises(ValueError, match=r"--expert_parallel=2: MyModel has no MoE layers "
                                         r"\(no tfbig.models.moe.SparseMoE layer"):
        moe_layers(own_model.model_fn(), "--expert_parallel=2")
