"""tfbig-prep: raw text -> tokenizer + TFRecord shards + manifest.json.

    tfbig-prep --output_dir=/data/shakespeare                 # embedded Shakespeare plays
    tfbig-prep --input='corpus/**/*.txt' --output_dir=/data/c --seq_length=1024 --vocab_size=32000 --num_workers=8
    tfbig-prep --input=web.jsonl --jsonl_field=text --output_dir=/data/web --tokenizer=spm.model --vocab_size=32000
    tfbig-prep --flagfile=prep.flags

Every flag maps onto an argument of `tfbig.prepare.prepare`.
"""

import sys

from absl import app, flags, logging

from tfbig import sources
from tfbig.formats import FORMATS
from tfbig.prepare import prepare

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("input", None, "Input files, directories (searched recursively for .txt/.md/.jsonl) "
                          "or globs; repeat the flag for several. Empty (and no --tfds_name): the embedded "
                          "Shakespeare plays.")
flags.DEFINE_string("output_dir", None, "Directory for shards, tokenizer.model and manifest.json. Default for "
                    "the embedded corpus: $TFBIG_CACHE or ~/.cache/tfbig/shakespeare-T{seq_length}-V{vocab_size}.")
flags.DEFINE_enum("format", "gpt", sorted(FORMATS), "Record format of the shards.")
flags.DEFINE_integer("seq_length", 1024, "Tokens per training example; each record holds seq_length + 1.")
flags.DEFINE_integer("vocab_size", 8000, "Vocabulary size of the tokenizer to train (or of --tokenizer).")
flags.DEFINE_string("tokenizer", None, "Existing SentencePiece .model file to use instead of training one; "
                    "it is copied next to the shards.")
flags.DEFINE_float("shard_size_mb", 1024, "Target size of one shard file in MiB.")
flags.DEFINE_integer("num_workers", 1, "Processes that tokenize and write shards in parallel.")
flags.DEFINE_bool("doc_per_line", False, "In .txt/.md inputs, each non-empty line is a document "
                  "(default: each file is one document).")
flags.DEFINE_string("jsonl_field", "text", "Field of each .jsonl line that holds the document text.")
flags.DEFINE_string("tfds_name", None, "TensorFlow Datasets dataset to read instead of files, e.g. "
                    "'my_corpus:1.0.0'. It must already be on disk: nothing is downloaded.")
flags.DEFINE_string("tfds_split", "train", "TFDS split to read.")
flags.DEFINE_string("tfds_text_key", "text", "TFDS feature holding the document text.")
flags.DEFINE_string("tfds_data_dir", None, "TFDS data_dir holding the prepared dataset (default: TFDS's own).")
flags.DEFINE_float("validation_fraction", 0.01, "Share of the input held out for validation, chosen as whole "
                   "files (or 1 MiB ranges of lines) spread evenly over the input. 0 = no validation split.")
flags.DEFINE_list("validation_plays", list(sources.DEFAULT_VALIDATION_PLAYS), "Embedded corpus only: plays "
                  "held out for validation (file names without .md).")
flags.DEFINE_float("tokenizer_sample_mb", 512, "At most this much training text (MiB) trains the tokenizer.")
flags.DEFINE_bool("overwrite", False, "Replace a directory prepared with other settings instead of refusing.")
flags.DEFINE_integer("seed", 0, "Seed for tokenizer training.")


def main(argv: list[str]) -> None:
    """Run `prepare` with the flags and print where the manifest went."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; inputs go in --input")
    try:
        manifest = _prepare_from_flags()
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"tfbig-prep: error: {error}")
    print(manifest.path)


def _prepare_from_flags():
    return prepare(
        FLAGS.input, FLAGS.output_dir, FLAGS.seq_length, FLAGS.vocab_size, FLAGS.shard_size_mb,
        FLAGS.num_workers, FLAGS.format, tokenizer=FLAGS.tokenizer, doc_per_line=FLAGS.doc_per_line,
        jsonl_field=FLAGS.jsonl_field, tfds_name=FLAGS.tfds_name or "", tfds_split=FLAGS.tfds_split,
        tfds_text_key=FLAGS.tfds_text_key, tfds_data_dir=FLAGS.tfds_data_dir,
        validation_fraction=FLAGS.validation_fraction, validation_plays=tuple(FLAGS.validation_plays),
        tokenizer_sample_mb=FLAGS.tokenizer_sample_mb, overwrite=FLAGS.overwrite, seed=FLAGS.seed)


def run() -> None:
    """Console-script entry point (`tfbig-prep`)."""
    logging.set_verbosity(logging.INFO)
    app.run(main)


if __name__ == "__main__":
    run()
