"""tfbig.data: raw text -> tokenizer + TFRecord shards + manifest.json -> batches.

The public surface. Preparation (no TensorFlow import, so prep worker processes stay light):

    prepare, prepare_locked, default_data_dir   the whole prep job (`tfbig-prep`)
    SourceSpec, Piece, DEFAULT_VALIDATION_PLAYS  what is read (files, compressed files, Wikipedia dumps,
                                                 TFDS, plays)
    Tokenizer                                    SentencePiece BPE with eos/pad
    WordPieceVocab, load_tokenizer               BERT's WordPiece vocab.txt (--format=bert)
    Manifest, SplitInfo, ShardInfo, load_manifest, write_manifest, MANIFEST_NAME
    Format, FORMATS, get_format                  record formats ("gpt", "albert", "bert")
    MaskingOptions, MaskingVocab                 ALBERT pairs and masks
    index_shards                                 a manifest for shards written by other tools

Reading (imports TensorFlow on first use):

    make_dataset, count_records                  batches of one prepared directory or of a weighted
                                                 mixture ("a:0.6,b:0.4")
    open_manifest, Mixture, parse_mixture, is_mixture, source_counts, source_tokens   mixtures (numpy only)

Modules, one job each: sources (pieces and documents), compression (streamed .gz/.bz2/.xz/.zst),
wikipedia (dump XML -> articles), tokenizer (+ bpe: GPT-2's vocab.json, tokenizer_json: a Hugging
Face tokenizer.json, albert_spm, wordpiece_vocab), tfrecord (writer without TF), formats + albert
(records), shards (parallel, resumable shard writing), manifest, prepare, index (foreign shards),
dataset (tf.data reader), mixture (weighted mixtures), beam (shard jobs on Apache Beam: tfbig-prep
--runner, optional extra).
Dependencies point one way: sources/tokenizer/tfrecord/albert <- formats <- shards <- prepare.
"""

from tfbig.data.albert import MaskingOptions, MaskingVocab
from tfbig.data.formats import FORMATS, Format, get_format
from tfbig.data.index import index_shards
from tfbig.data.manifest import (MANIFEST_NAME, Manifest, ShardInfo, SplitInfo, load_manifest,
                                 write_manifest)
from tfbig.data.mixture import (Mixture, is_mixture, open_manifest, parse_mixture, source_counts,
                                source_tokens)
from tfbig.data.prepare import default_data_dir, prepare, prepare_locked
from tfbig.data.source_spec import Piece, SourceSpec
from tfbig.data.sources import DEFAULT_VALIDATION_PLAYS
from tfbig.data.tokenizer import Tokenizer, load_tokenizer, run_tokenizer_files
from tfbig.data.wordpiece_vocab import WordPieceVocab

# Reading needs TensorFlow: imported when first used, so `import tfbig.data` in a prep worker stays light.
_LAZY = {"make_dataset": "dataset", "count_records": "dataset", "MAX_PARALLEL_FILES": "dataset"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"tfbig.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tfbig.data' has no attribute {name!r}")


__all__ = ["DEFAULT_VALIDATION_PLAYS", "FORMATS", "MANIFEST_NAME", "Format", "Manifest", "MaskingOptions",
           "MaskingVocab", "Mixture", "Piece", "ShardInfo", "SourceSpec", "SplitInfo", "Tokenizer", "WordPieceVocab", "load_tokenizer", "run_tokenizer_files",
           "default_data_dir", "get_format", "index_shards", "is_mixture", "load_manifest", "open_manifest",
           "parse_mixture", "prepare", "prepare_locked", "source_counts", "source_tokens", "write_manifest",
           *_LAZY]
