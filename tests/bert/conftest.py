"""Fixtures for BERT pretraining tests: a WordPiece vocabulary and a "bert" data directory."""
import pytest

from tfbig.data import sources

PLAYS = ("hamlet", "macbeth", "othello", "twelfth-night")  # twelfth-night: a validation play


def play_scenes(names=PLAYS):
    """Scenes of a few embedded plays, as tfbig-prep's documents."""
    texts = []
    for path in sources.shakespeare_plays():
        if sources.play_name(path) in names:
            with open(path, encoding="utf-8") as file:
                texts += sources.play_scenes(file.read())
    return texts


@pytest.fixture(scope="session")
def bert_scenes():
    return play_scenes()


@pytest.fixture(scope="session")
def bert_vocab(tmp_path_factory, bert_scenes):
    """A 1000-piece uncased WordPiece vocabulary trained on four plays."""
    from tfbig.data import WordPieceVocab

    return WordPieceVocab.train(bert_scenes, 1000, str(tmp_path_factory.mktemp("wp") / "vocab.txt"))


def prepare_bert(out, vocab, scenes_dir=None, **options):
    from tfbig.data import prepare

    return prepare([str(scenes_dir)], str(out), seq_length=64, vocab_size=1000, shard_size_mb=0.2,
                   tokenizer=vocab.path, validation_fraction=0.2, format="bert",
                   format_options={"max_predictions_per_seq": 12, **options})


@pytest.fixture(scope="session")
def bert_scene_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_text")
    for index, scene in enumerate(play_scenes()):  # a file is a document: one per scene
        (root / f"scene{index:03d}.txt").write_text(scene, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def bert_data_dir(tmp_path_factory, bert_vocab, bert_scene_files):
    """tfbig-prep --format=bert of four plays: seq_length 64, 12 predictions, whole words."""
    out = tmp_path_factory.mktemp("bert_data")
    prepare_bert(out, bert_vocab, bert_scene_files)
    return str(out)
