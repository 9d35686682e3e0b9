"""The one reader of a sharded checkpoint's layout file (tfbig.checkpoints.checkpoint), shared by the
tensor-parallel, ZeRO and cross-rank pipeline layouts, and the checks before consolidating one
(tfbig.training.consolidate)."""
import pytest

from tfbig.checkpoints import checkpoint
from tfbig import config as config_lib
from tfbig.training import consolidate
from tfbig.commands import consolidate as consolidate_command
from tfbig.layouts import tensor_layout, zero_checkpoint
from tfbig.layouts import stage_checkpoint


def a_run(tmp_path, filename, layout, model="gpt"):
    run = tmp_path / "run"
    run.mkdir()
    checkpoint.write_layout(str(run), filename, layout)
    cfg = config_lib.ExperimentConfig()
    cfg.train.batch_size, cfg.train.model = 6, model
    config_lib.save_json(cfg, str(run / "config.json"))
    return run


def test_each_layout_reads_its_own_file_and_none_when_absent(tmp_path):
    run = a_run(tmp_path, "tensor.json",
                {"tensor_parallel": 2, "splits": {"block_0/mlp/fc/kernel": [1, [2, 2]]}})
    assert tensor_layout.read_layout(str(run)) == {
        "tensor_parallel": 2, "splits": {"block_0/mlp/fc/kernel": (1, [2, 2])}}
    assert zero_checkpoint.read_layout(str(run)) is None
    assert stage_checkpoint.read_layout(str(run)) is None
    checkpoint.write_layout(str(run), "pipeline.json", {"pipeline_stages": 2, "stages": []})
    assert stage_checkpoint.read_layout(str(run)) == {"pipeline_stages": 2, "stages": []}


def test_consolidation_input_returns_the_layout_and_the_runs_config(tmp_path):
    run = a_run(tmp_path, "zero.json", {"zero_stage": 1, "shard_degree": 2})
    layout, cfg = consolidate.consolidation_input(str(run), str(tmp_path / "out"), "zero.json",
                                                  "a --zero_stage run")
    assert layout == {"zero_stage": 1, "shard_degree": 2}
    assert cfg.train.batch_size == 6


@pytest.mark.parametrize("consolidate, message", [
    (consolidate.consolidate_tensor, "no tensor.json: it is not a tensor-parallel run"),
    (consolidate.consolidate_zero, "no zero.json: it is not a --zero_stage run"),
    (consolidate.consolidate_pipeline, "no pipeline.json: it is not a cross-rank pipeline run"),
    (consolidate.consolidate, "zero.json: it is not a sharded run"),
])
def test_every_layout_refuses_a_run_without_its_layout_file(tmp_path, consolidate, message):
    run = a_run(tmp_path, "other.json", {})
    with pytest.raises(ValueError, match=message):
        consolidate(str(run), str(tmp_path / "out"))


def test_consolidation_refuses_to_write_into_the_run_it_reads(tmp_path):
    run = a_run(tmp_path, "pipeline.json", {"pipeline_stages": 2, "stages": []})
    with pytest.raises(ValueError, match="output directory must differ"):
        consolidate.consolidate(str(run), str(run))


@pytest.mark.parametrize("model, command", [("classify", "tfbig-classify"),
                                            ("squad", "tfbig-squad")])
@pytest.mark.parametrize("filename, layout", [
    ("zero.json", {"zero_stage": 2, "shard_degree": 2}),
    ("tensor.json", {"tensor_parallel": 2, "splits": {}}),
    ("pipeline.json", {"pipeline_stages": 2, "stages": []})])
def test_a_fine_tuning_run_is_refused_by_name(tmp_path, capsys, model, command, filename,
                                              layout):
    """A sharded tfbig-classify / tfbig-squad run: its task needs the command's flags and
    files, which config.json lacks; the command says so (exit 2) and names what to use."""
    run = a_run(tmp_path, filename, layout, model=model)
    assert consolidate_command.main([str(run), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert f"is a {command} run" in error and "is not consolidated" in error
    assert f"predict from it with {command}" in error and not (tmp_path / "out").exists()
