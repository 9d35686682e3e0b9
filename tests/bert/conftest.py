"""Fixtures for BERT pretraining tests: a WordPiece vocabulary and a "bert" data directory."""
import pytest


@pytest.fixture(scope="session")
def bert_vocab(tmp_path_factory, scenes):
    """A 1000-piece uncased WordPiece vocabulary trained on four plays."""
    from tfbig.data import WordPieceVocab

    return WordPieceVocab.train(scenes, 1000, str(tmp_path_factory.mktemp("wp") / "vocab.txt"))


def _prepare_bert(out, vocab, scenes_dir=None, **options):
    from tfbig.data import prepare

    return prepare([str(scenes_dir)], str(out), seq_length=64, vocab_size=1000, shard_size_mb=0.2,
                   tokenizer=vocab.path, validation_fraction=0.2, format="bert",
                   format_options={"max_predictions_per_seq": 12, **options})


@pytest.fixture(scope="session")
def prepare_bert():
    """tfbig-prep --format=bert of a directory of scenes with `vocab`: (out, vocab, dir)."""
    return _prepare_bert


@pytest.fixture(scope="session")
def bert_data_dir(tmp_path_factory, bert_vocab, scene_files):
    """tfbig-prep --format=bert of four plays: seq_length 64, 12 predictions, whole words."""
    out = tmp_path_factory.mktemp("bert_data")
    _prepare_bert(out, bert_vocab, scene_files)
    return str(out)
