"""tfbig-prep on Apache Beam (--runner=direct) writes the local path's shards and manifest, byte for byte.

Apache Beam is an optional extra that cannot share the pinned TensorFlow 2.20 environment (it pins
protobuf < 7); the DirectRunner test runs where `apache_beam` imports (see README, "Data").
"""
import os
import sys

import pytest

from tfbig.data import prepare

SEQ, VOCAB = 16, 400


def _files(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))
            if name.endswith((".tfrecord", ".json", ".model"))}


@pytest.mark.parametrize("num_workers", [1, 2])
def test_direct_runner_writes_the_local_shards_and_manifest(corpus_dir, tmp_path, num_workers):
    pytest.importorskip("apache_beam", reason="Apache Beam is the optional extra tfbig[beam] (pins protobuf<7)")
    settings = dict(seq_length=SEQ, vocab_size=VOCAB, shard_size_mb=0.004, validation_fraction=0.2)
    local = prepare([corpus_dir], str(tmp_path / "local"), num_workers=2, **settings)
    beam = prepare([corpus_dir], str(tmp_path / "beam"), num_workers=num_workers, runner="direct", **settings)
    assert len(local.split("train").shards) >= 3
    assert _files(beam.data_dir) == _files(local.data_dir)  # shards, manifest.json, tokenizer, byte for byte


def test_unknown_runner_and_missing_beam_are_clear_errors(corpus_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--runner='spark2': expected local or one of \['dataflow', 'direct'"):
        prepare([corpus_dir], str(tmp_path / "a"), SEQ, VOCAB, runner="spark2")
    assert not os.path.exists(tmp_path / "a")  # refused before any work
    monkeypatch.setitem(sys.modules, "apache_beam", None)  # as where the extra is not installed
    monkeypatch.setitem(sys.modules, "apache_beam.options.pipeline_options", None)
    with pytest.raises(ValueError, match=r"--runner=direct needs Apache Beam, an optional extra"):
        prepare([corpus_dir], str(tmp_path / "b"), SEQ, VOCAB, shard_size_mb=0.004, runner="direct")
