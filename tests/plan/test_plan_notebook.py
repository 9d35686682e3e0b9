"""notebooks/plan.ipynb runs top to bottom (code cells in order, one namespace)."""
import json
import os

import matplotlib

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "plan.ipynb")


def test_plan_notebook_draws_memory_curves_and_the_comparison():
    matplotlib.use("Agg")
    with open(NOTEBOOK) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] for c in cells)  # outputs are stripped in git
    namespace = {}
    for cell in cells:
        exec(compile("".join(cell["source"]), "plan.ipynb", "exec"), namespace)
    curves = namespace["memory_curves"]["175b"]
    assert all(v > 80 for v in curves["data parallel"])  # 175B never fits replicated
    zero3 = [v for v in curves["ZeRO-3"] if v is not None]
    assert zero3 == sorted(zero3, reverse=True) and zero3[-1] < 80
    for row in namespace["comparison"]:
        predicted, measured = row["peak_bytes"]
        assert abs(measured / predicted - 1) < 0.10, row
