"""The notebooks run top to bottom (their code cells, in order, in one namespace)."""
import json
import os

import matplotlib

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


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
