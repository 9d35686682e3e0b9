"""Fixtures for SQuAD tests: the embedded QA set of two plays and a tokenizer for it."""
import pytest

from data_prep import shakespeare_qa
from tfbig.data import shakespeare

TRAIN_PLAYS = ("macbeth",)
DEV_PLAYS = ("twelfth-night",)


def plays(names):
    return [p for p in shakespeare.shakespeare_plays() if shakespeare.play_name(p) in names]


@pytest.fixture(scope="session")
def qa_play_paths():
    """(training play paths, dev play paths) of the QA fixtures."""
    return plays(TRAIN_PLAYS), plays(DEV_PLAYS)


@pytest.fixture(scope="session")
def qa_sets():
    """{(version, split): SQuAD dict} for one training and one dev play."""
    return {(version, split): shakespeare_qa.build(plays(names), version)
            for version in ("1.1", "2.0")
            for split, names in (("train", TRAIN_PLAYS), ("dev", DEV_PLAYS))}


@pytest.fixture(scope="session")
def qa_tokenizer(tmp_path_factory):
    """A 600-piece tfbig tokenizer trained on the two plays."""
    from tfbig.data import Tokenizer

    texts = []
    for path in plays(TRAIN_PLAYS + DEV_PLAYS):
        with open(path, encoding="utf-8") as file:
            texts += shakespeare.play_scenes(file.read())
    return Tokenizer.train(texts, 600, str(tmp_path_factory.mktemp("qa_tok") / "tokenizer"))
