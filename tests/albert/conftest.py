"""Fixtures for ALBERT tests: a tokenizer and a small ALBERT-format data directory."""
import pytest


@pytest.fixture(scope="session")
def albert_tokenizer(tmp_path_factory, scenes):
    """A 1000-piece tfbig tokenizer trained on four plays."""
    from tfbig.data import Tokenizer

    return Tokenizer.train(scenes, 1000, str(tmp_path_factory.mktemp("tok") / "tokenizer"))


@pytest.fixture(scope="session")
def albert_data_dir(tmp_path_factory, albert_tokenizer, scene_files):
    """tfbig-prep --format=albert of four plays: seq_length 64, two train shards."""
    from tfbig.data import prepare

    out = str(tmp_path_factory.mktemp("albert_data"))
    prepare([str(scene_files)], out, seq_length=64, vocab_size=1000, shard_size_mb=0.5,
            tokenizer=albert_tokenizer.path, doc_per_line=False, validation_fraction=0.2,
            format="albert", format_options={"max_predictions_per_seq": 12, "dupe_factor": 1})
    return out
