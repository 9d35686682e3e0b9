"""The one table of the layout pairs tfbig-train refuses (tfbig.layouts.composition): each row
refused by the backend registry before any backend starts, naming both flags; listed in the
docs' table; never searched by tfbig-plan. The pairs that compose are proven equal to one
process by the launches of test_context_parallel (CP x ZeRO-1/2/3, CP x TP), test_tensor_parallel
(TP x ZeRO-1/2/3), test_tensor_pipeline (PP x TP), test_expert_parallel (EP x ZeRO-1/2, EP x
TP) and the others."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "pipeline"))
sys.path.insert(0, os.path.join(ROOT, "tests", "plan"))
from test_cross_rank import cfg_with  # noqa: E402
from test_plan import plan  # noqa: E402

from tfbig.errors import UsageError  # noqa: E402
from tfbig.layouts import composition  # noqa: E402
from tfbig.training.registry import horovod_backend  # noqa: E402

IN_USE = {"tensor_parallel": 2, "pipeline_stages": 2, "context_parallel": 2,
          "expert_parallel": 2, "sequence_parallel": True, "zero_stage": 1, "shard_degree": 2,
          "elastic": True, "zero_stage>=2": 2, "zero_stage>=3": 3}  # a table entry `name>=N`: from N on


@pytest.mark.parametrize("first, second", [(a, b) for a, b, _ in composition.REFUSED])
def test_each_refused_pair_is_named_before_any_backend_starts(first, second):
    values = {name: IN_USE[part] for spec in (first, second) for part in spec.split("+")
              for name in composition.flag_names(part)}
    with pytest.raises(UsageError) as error:
        horovod_backend(cfg_with(**values))  # raises before hvd.init: nothing started
    message = str(error.value)
    for name, value in values.items():
        shown = f"--{name}" if isinstance(value, bool) else f"--{name}={value}"
        assert shown in message
    assert message == composition.refusal(values)
    assert "is not supported: " in message


def test_the_docs_table_lists_every_refused_pair_and_nothing_else():
    with open(os.path.join(ROOT, "docs", "guides", "scale-out.md")) as f:
        text = f.read()
    table = text[text.index("### What does not compose"):]
    table = table[:table.index("\n\n", table.index("| flag | with | why |"))]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    listed = [(a.strip().strip("`").removeprefix("--"),
               b.strip().strip("`").removeprefix("--").replace("+--", "+")) for a, b in rows]
    assert len(listed) == len(set(listed))
    assert set(listed) == {(a, b) for a, b, _ in composition.REFUSED}


def test_the_pairs_the_launches_prove_compose():
    for values in ({"tensor_parallel": 2, "zero_stage": 3}, {"tensor_parallel": 2,
                   "zero_stage": 2, "sequence_parallel": True}, {"context_parallel": 2,
                   "zero_stage": 3}, {"context_parallel": 2, "tensor_parallel": 2,
                   "zero_stage": 1}, {"pipeline_stages": 2, "tensor_parallel": 2},
                   {"pipeline_stages": 2, "zero_stage": 1, "shard_degree": 2},
                   {"pipeline_stages": 2, "tensor_parallel": 2, "zero_stage": 1},
                   {"expert_parallel": 2, "zero_stage": 1}, {"expert_parallel": 2,
                   "zero_stage": 2, "shard_degree": 4}, {"expert_parallel": 2,
                   "tensor_parallel": 2}, {"elastic": True, "zero_stage": 1},
                   {"elastic": True, "zero_stage": 3}, {"context_parallel": 2,
                   "tensor_parallel": 2, "sequence_parallel": True}, {"expert_parallel": 2,
                   "pipeline_stages": 2, "zero_stage": 1}, {"elastic": True,
                   "tensor_parallel": 2}):
        assert composition.refusal(values) is None, values
    # a `name>=N` entry: refused from N on, with the value the flags hold
    for stage in (2, 3):
        assert composition.refusal({"pipeline_stages": 4, "zero_stage": stage}).startswith(
            f"--pipeline_stages=4 with --zero_stage={stage} is not supported: ")


def test_the_planner_searches_no_refused_pair():
    _, _, found = plan(["--preset=small", "--seq_length=4096", "--gpus_per_node=8",
                        "--nodes=2", "--batch_size=64"])
    assert {(e.layout.tensor > 1, e.layout.zero_stage) for e in found} >= {(True, 3), (False, 3)}
    assert any(e.layout.context > 1 and e.layout.zero_stage == 3 for e in found)
    assert all(composition.refusal(e.layout.flags()) is None for e in found)


@pytest.mark.parametrize("flag", composition.GROUPED)
def test_elastic_composes_with_each_layout_with_groups_by_restarting(flag):
    """--elastic with a layout whose groups are process sets composes by restarting
    (tfbig.distribute.elastic.with_restarts; the launch: test_elastic.py, slow); data
    parallelism and ZeRO over the whole world stay elastic in the process."""
    values = {"elastic": True, flag: IN_USE[flag]}
    if flag == "shard_degree":
        values["zero_stage"] = 1
    assert composition.refusal(values) is None
    assert composition.grouped(values) == [flag]
    assert composition.grouped({"elastic": True, "zero_stage": 3}) == []
