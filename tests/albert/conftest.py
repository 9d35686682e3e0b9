"""Fixtures for ALBERT tests: a tokenizer and a small ALBERT-format data directory."""
import pytest

from tfbig.data import sources

PLAYS = ("hamlet", "macbeth", "othello", "twelfth-night")  # twelfth-night: a validation play


def play_texts(names=PLAYS):
    """Scenes of a few embedded plays, as tfbig-prep's documents."""
    texts = []
    for path in sources.shakespeare_plays():
        if sources.play_name(path) in names:
            with open(path, encoding="utf-8") as file:
                texts += sources.play_scenes(file.read())
    return texts


@pytest.fixture(scope="session")
def scenes():
    return play_texts()


@pytest.fixture(scope="session")
def albert_tokenizer(tmp_path_factory, scenes):
    """A 1000-piece tfbig tokenizer trained on four plays."""
    from tfbig.data import Tokenizer

    return Tokenizer.train(scenes, 1000, str(tmp_path_factory.mktemp("tok") / "tokenizer"))


@pytest.fixture(scope="session")
def albert_data_dir(tmp_path_factory, albert_tokenizer):
    """tfbig-prep --format=albert of four plays: seq_length 64, two train shards."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("albert_text")
    for index, scene in enumerate(play_texts()):  # a file is a document: one per scene
        (root / f"scene{index:03d}.txt").write_text(scene, encoding="utf-8")
    out = str(tmp_path_factory.mktemp("albert_data"))
    prepare([str(root)], out, seq_length=64, vocab_size=1000, shard_size_mb=0.5,
            tokenizer=albert_tokenizer.path, doc_per_line=False, validation_fraction=0.2,
            format="albert", format_options={"max_predictions_per_seq": 12, "dupe_factor": 1})
    return out
