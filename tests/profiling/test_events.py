"""tfbig.profiling.events reads back the scalars a run's RunLogger wrote (real event files)."""
import os

import pytest

from tfbig.training.logs import RunLogger
from tfbig.profiling.events import compare_runs, read_scalars


def write_run(directory, losses, resumed=()):
    logger = RunLogger(str(directory), enabled=True, max_steps=len(losses))
    for step, loss in enumerate(losses, start=1):
        logger.scalars("train", step, {"loss": loss, "time_fraction/input": 0.25})
    logger.text("train", 1, "sample", "ROMEO. Good night.")
    logger.scalars("validation", len(losses), {"bits_per_byte": 2.5})
    logger.flush()
    if resumed:  # a second process (a resume) writes its own event file over the same steps
        train = directory / "train"
        first = set(os.listdir(train))
        again = RunLogger(str(directory), enabled=True, max_steps=len(losses))
        for step, loss in resumed:
            again.scalars("train", step, {"loss": loss})
        again.flush()
        (later,) = set(os.listdir(train)) - first
        # Names carry whole seconds and an unpadded counter (...9 sorts after ...10): give the
        # resume's file a name that sorts first, as a resume in the same second past 9 gets.
        os.rename(train / later, train / ("events.out.tfevents.0." + later))


def test_scalars_come_back_by_split_and_tag_with_the_resumed_values(tmp_path):
    write_run(tmp_path / "a", [4.0, 3.5, 3.0])
    write_run(tmp_path / "b", [5.0, 4.0], resumed=[(2, 3.9), (3, 3.7)])
    a = read_scalars(str(tmp_path / "a"))
    assert a["train"]["loss"] == [(1, 4.0), (2, 3.5), (3, 3.0)]
    assert a["train"]["time_fraction/input"] == [(1, 0.25), (2, 0.25), (3, 0.25)]
    assert a["validation"] == {"bits_per_byte": [(3, 2.5)]}
    assert "sample" not in a["train"]  # text summaries are not scalars
    curves = compare_runs([str(tmp_path / "a"), str(tmp_path / "b")], "train", "loss")
    assert curves[str(tmp_path / "b")] == [(1, 5.0), (2, pytest.approx(3.9)),
                                           (3, pytest.approx(3.7))]


def test_a_directory_without_events_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        read_scalars(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no TensorBoard scalars"):
        read_scalars(str(tmp_path / "empty"))
