"""Manifest loading and checking: every error names the file, the field and both values."""
import json
import math
import os

import pytest

from tfbig.data import load_manifest


def test_loads_a_prepared_directory(single_shard_dir):
    manifest = load_manifest(single_shard_dir)
    assert (manifest.format, manifest.seq_length, manifest.vocab_size) == ("gpt", 16, 400)
    assert manifest.shard_paths("train") == [os.path.join(single_shard_dir, "train-00000-of-00001.tfrecord")]
    train = manifest.split("train")
    assert train.records == sum(s.records for s in train.shards) == train["records"]
    assert train.tokens == 17 * train.records
    assert 0 < train.bytes < 4 * train.tokens
    assert manifest.bits_per_byte(math.log(2)) == pytest.approx(manifest.splits["validation"].tokens
                                                                / manifest.splits["validation"].bytes)


def test_check_names_path_field_and_values(single_shard_dir):
    manifest = load_manifest(single_shard_dir)
    manifest.check(format="gpt", seq_length=16, vocab_size=400)
    path = os.path.join(single_shard_dir, "manifest.json")
    with pytest.raises(ValueError, match=rf"{path}: seq_length is 16 but 32 was expected"):
        manifest.check(seq_length=32)
    with pytest.raises(ValueError, match=r"vocab_size is 400 but 50257 was expected"):
        manifest.check(vocab_size=50257)
    with pytest.raises(ValueError, match=r"format is 'gpt' but 'albert' was expected"):
        manifest.check(format="albert")
    with pytest.raises(ValueError, match=r"no split 'test'.*\['train', 'validation'\]"):
        manifest.shard_paths("test")


def test_missing_invalid_and_unknown_schema(tmp_path, single_shard_dir):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "manifest.json")):
        load_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(ValueError, match="manifest.json is not valid JSON"):
        load_manifest(str(tmp_path))
    content = json.loads(open(os.path.join(single_shard_dir, "manifest.json")).read())
    (tmp_path / "manifest.json").write_text(json.dumps({**content, "schema_version": 7}))
    with pytest.raises(ValueError, match="schema_version is 7 but this tfbig reads 1"):
        load_manifest(str(tmp_path))
    del content["eos_id"]
    (tmp_path / "manifest.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['eos_id'\]"):
        load_manifest(str(tmp_path))
