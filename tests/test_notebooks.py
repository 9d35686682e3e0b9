"""The notebooks run top to bottom (their code cells, in order, in one namespace)."""
import json
import os

import matplotlib
import pytest

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


@pytest.mark.slow  # runs the notebook in a kernel (~30 s); the same training and generation: tests/test_trainer.py
def test_quickstart_notebook_trains_and_generates(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.setenv("TFBIG_NOTEBOOK_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TFBIG_NOTEBOOK_STEPS", "30")
    monkeypatch.setenv("TFBIG_CACHE", str(tmp_path / "cache"))
    with open(os.path.join(NOTEBOOKS, "quickstart.ipynb")) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    namespace = {}
    for cell in cells:
        exec(compile("".join(cell["source"]), "quickstart.ipynb", "exec"), namespace)
    assert namespace["summary"]["step"] == 30
    assert len(namespace["loss_curve"]) >= 2
    assert namespace["loss_curve"][-1][1] < namespace["loss_curve"][0][1]
    assert namespace["text"].startswith("ROMEO") and len(namespace["text"]) > 20


def run_notebook(name, run_dir, steps, monkeypatch):
    """The namespace after executing notebooks/NAME's code cells in order."""
    matplotlib.use("Agg")
    monkeypatch.setenv("TFBIG_NOTEBOOK_RUN_DIR", str(run_dir))
    monkeypatch.setenv("TFBIG_NOTEBOOK_STEPS", str(steps))
    with open(os.path.join(NOTEBOOKS, name)) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] for c in cells)  # outputs are stripped in git
    namespace = {}
    for cell in cells:
        exec(compile("".join(cell["source"]), name, "exec"), namespace)
    return namespace


@pytest.mark.slow
def test_runs_notebook_reads_and_compares_two_runs(tmp_path, monkeypatch):
    ns = run_notebook("runs.ipynb", tmp_path, 30, monkeypatch)
    losses = {name: s["train"]["loss"] for name, s in ns["scalars"].items()}
    assert [len(points) for points in losses.values()] == [3, 3]  # logged every 10 steps
    assert losses["lr 3e-3"][-1][1] < losses["lr 3e-4"][-1][1]  # the larger rate learns faster
    for name, shares in ns["breakdown"].items():
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6) and shares["compute"] > 0.5
    assert all("bits_per_byte" in ns["scalars"][name]["validation"] for name in ns["RUNS"])
    assert all(kinds for kinds in ns["findings"].values())


@pytest.mark.slow
@pytest.mark.multiproc
def test_scaling_notebook_runs_three_backends_on_the_same_curve(tmp_path, monkeypatch):
    ns = run_notebook("scaling.ipynb", tmp_path, 20, monkeypatch)
    assert set(ns["losses"]) == {"one process", "horovod x2", "pipeline x2"}
    assert ns["gap"]["pipeline x2"] < 1e-5  # the same batches: the same losses
    assert ns["gap"]["horovod x2"] < 0.05  # other examples of the same data: within the noise
    assert all(v > 0 for v in ns["tokens_per_sec"].values())


def test_data_notebook_reads_shards_tokenizer_and_documents(gpt_data, monkeypatch):
    monkeypatch.setenv("TFBIG_NOTEBOOK_DATA_DIR", gpt_data)
    ns = run_notebook("data.ipynb", gpt_data, 0, monkeypatch)
    manifest = ns["manifest"]
    assert len(ns["table"]) == sum(len(s.shards) for s in manifest.splits.values())
    assert ns["rows"].shape[1] == manifest.seq_length + 1
    assert ns["lengths"] and all(n >= 0 for n in ns["lengths"])
    assert sum(ns["lengths"]) + len(ns["lengths"]) <= ns["rows"].size  # docs + their eos fit
    assert ns["per_byte"]["validation"] == manifest.splits["validation"].tokens / (
        manifest.splits["validation"].bytes)


@pytest.mark.slow
@pytest.mark.multiproc
def test_your_model_notebook_trains_my_model_in_process_then_on_two_horovod_ranks(
        tmp_path, monkeypatch):
    ns = run_notebook("your_model.ipynb", tmp_path, 6, monkeypatch)
    assert set(ns["losses"]) == {"one process", "horovod x2"}
    assert [len(curve) for curve in ns["losses"].values()] == [6, 6]
    assert ns["losses"]["one process"][-1] < ns["losses"]["one process"][0]
    assert ns["gap"] < 1e-4  # the same global batches: the same curve
