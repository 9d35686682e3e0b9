"""An input that is one piece (one compressed JSONL file, one bz2 Wikipedia dump part, one small
file) prepares with the default --validation_fraction, holding out documents inside the piece,
and trains with a validation pass. The .jsonl.zst case runs by default, the others are slow."""
import bz2
import json
import os
import random
from collections import Counter

import pytest
import zstandard

from tfbig.data import load_manifest, prepare, source_spec, sources

SEQ, VOCAB = 16, 400


def _documents(document_maker, count, seed=0):
    rng = random.Random(seed)
    return [document_maker(rng, 4) for _ in range(count)]


def _jsonl_zst(path, documents):
    data = "".join(json.dumps({"text": d}) + "\n" for d in documents).encode()
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
    return path


def _wiki_bz2(path, documents):
    from xml.sax.saxutils import escape

    pages = "".join(f"<page><title>Article {i}</title><ns>0</ns><id>{i}</id><revision><id>1</id>"
                    f'<text xml:space="preserve">{escape(d)}</text></revision></page>' for i, d in enumerate(documents))
    path.write_bytes(bz2.compress(('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/">'
                                   + pages + "</mediawiki>\n").encode()))
    return path


def _lines_file(path, documents):
    path.write_text("".join(d.replace("\n", " ") + "\n" for d in documents), encoding="utf-8")
    return path


def _text_file(path, documents):
    path.write_text("\n\n".join(documents), encoding="utf-8")  # one document of paragraphs
    return path


INPUTS = {"jsonl.zst": (_jsonl_zst, "corpus.jsonl.zst", {}), "wiki.bz2": (_wiki_bz2, "enwiki-p1.xml.bz2", {}),
          "lines": (_lines_file, "lee.txt", {"doc_per_line": True}), "text": (_text_file, "book.txt", {})}


@pytest.mark.parametrize("kind", ["jsonl.zst"] + [pytest.param(kind, marks=pytest.mark.slow)
                                                  for kind in ("wiki.bz2", "lines", "text")])
def test_one_piece_holds_out_documents_and_trains_with_validation(kind, tmp_path, document_maker, multi_shard_dir):
    write, name, options = INPUTS[kind]
    documents = _documents(document_maker, 300)
    path = write(tmp_path / name, documents)
    spec = source_spec.SourceSpec(inputs=(str(path),), **options)
    assert len(sources.plan_pieces(spec, 1 << 20)) == 1  # one piece: no whole piece to hold out
    manifest = prepare([str(path)], str(tmp_path / "data"), SEQ, VOCAB, shard_size_mb=1, **options,
                       tokenizer=os.path.join(multi_shard_dir, "tokenizer.model"))  # the default fraction, 0.01
    assert 0 < manifest.split("validation").records < manifest.split("train").records / 20
    if kind != "lines":  # --doc_per_line input is cut into more pieces (byte ranges) instead
        assert load_manifest(manifest.data_dir).info["validation_split"]["by"] == "document"
        assert manifest.info["validation_split"]["fraction"] == 0.01
    # No document is in both splits.
    train_pieces, validation_pieces = sources.plan_splits(spec, 1 << 20, 0.01)
    held, kept = ([d for p in pieces for d in sources.read_documents(p, spec, Counter())]
                  for pieces in (validation_pieces, train_pieces))
    assert held and not set(held) & set(kept)
    _train_with_validation(manifest.data_dir, tmp_path / "run")


def _train_with_validation(data_dir, model_dir):
    from tfbig.config import ExperimentConfig
    from tfbig.training.trainer import Trainer

    cfg = ExperimentConfig()
    for key, value in dict(data_dir=data_dir, model_dir=str(model_dir), preset="tiny", seq_length=SEQ, num_layers=1,
                           hidden_size=16, num_heads=2, batch_size=2, max_steps=2, warmup_steps=1, log_every=1,
                           eval_steps=1, deterministic=True, sample_tokens=0, xla=False).items():
        setattr(cfg.train, key, value)
    cfg.profile.peak_tflops = 1.0
    summary = Trainer(cfg).fit()
    assert summary["eval"]["loss"] > 0 and "bits_per_byte" in summary["eval"]
