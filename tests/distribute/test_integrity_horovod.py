"""Damaged checkpoints under --strategy=horovod: rank 0 verifies and restores the newest intact
checkpoint, the other rank follows through the broadcast (one real 2-rank launch); tensor ranks
whose pieces' newest intact checkpoints are of different steps are refused by name."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import horovodrun, horovod_cfg, read  # noqa: E402
from test_integrity import DAMAGE  # noqa: E402
from tfbig import config as config_lib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def resumed(gpt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity_horovod")
    cfg = horovod_cfg(gpt_data, root / "run", max_steps=4, checkpoint_every=2)
    plan = {"config": config_lib.to_dict(cfg), "out": str(root), "damage": sorted(DAMAGE)}
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([os.path.join(HERE, "integrity_worker.py"), str(root / "plan.json")],
                      root / "log.txt")
    assert code == 0, read(root / "log.txt")[-6000:]

    def results(kind):
        return [json.load(open(root / f"{kind}.rank{r}.json")) for r in (0, 1)]
    return results


@pytest.mark.slow  # ~40 s; the single-device cases in tests/test_integrity.py run by default
@pytest.mark.multiproc
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_horovod_resume_skips_a_damaged_checkpoint_on_every_rank(resumed, kind):
    rank0, rank1 = resumed(kind)
    run = rank0["run"]
    assert rank0["restored_from"] == os.path.join(run, "ckpt-2")
    assert rank1["restored_from"] is None  # rank 1 does not read the checkpoint itself ...
    assert rank0["restored_step"] == rank1["restored_step"] == 2  # ... it follows rank 0
    warnings = [m for m in rank0["messages"] if m.startswith("WARNING")]
    damaged = os.path.join(run, "ckpt-4.data-00000-of-00001")
    assert len(warnings) == 1 and f"({damaged}: " in warnings[0], warnings
    assert not [m for m in rank1["messages"] if m.startswith("WARNING")]
    assert os.path.exists(os.path.join(run, "ckpt-4.index.damaged"))
    # Both ranks trained on from step 2 to the weights of the undamaged run.
    assert rank0["checksum"] == pytest.approx(rank0["straight"], rel=1e-6)
    assert rank1["checksum"] == rank0["checksum"]


@pytest.mark.multiproc  # two 2-rank launches, ~20 s
def test_tensor_ranks_resumed_from_different_steps_are_refused(gpt_data, tmp_path):
    """TP2 trains 8 steps (checkpoints at 4 and 8); tensor rank 1's step-8 piece is then lost
    (a save cut short on that rank): it resumes from step 4, rank 0 from step 8. The second
    start stops before any step, naming each rank's step, and deletes nothing."""
    import glob
    import subprocess

    from test_elastic import HOROVODRUN, ROOT, cli_flags

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}

    def start(steps, log):
        command = [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
                   "tfbig.commands.train", *cli_flags(gpt_data, str(run), strategy="horovod",
                                                       tensor_parallel=2, max_steps=steps)]
        with open(log, "w") as out:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  cwd=ROOT, timeout=600).returncode

    assert start(8, tmp_path / "first.txt") == 0, read(tmp_path / "first.txt")[-4000:]
    piece = run / "tensor" / "rank-1"
    for path in glob.glob(str(piece / "ckpt-8.*")):
        os.remove(path)
    kept = sorted(os.listdir(run))
    assert start(12, tmp_path / "second.txt") != 0
    output = read(tmp_path / "second.txt")
    assert "the processes resumed from checkpoints of different steps (rank 0: step 8, rank 1: " \
           "step 4)" in output, output[-4000:]
    assert "Remove every piece's checkpoints newer than step 4" in output
    assert sorted(os.listdir(run)) == kept and (run / "ckpt-8.index").exists()
