"""tfbig-prep: raw text -> tokenizer + TFRecord shards + manifest.json.

    tfbig-prep --output_dir=/data/shakespeare                 # embedded Shakespeare plays
    tfbig-prep --input='corpus/**/*.txt' --output_dir=/data/c --seq_length=1024 --vocab_size=32000 --num_workers=8
    tfbig-prep --input=web.jsonl --jsonl_field=text --output_dir=/data/web --tokenizer=spm.model --vocab_size=32000
    tfbig-prep --format=albert --seq_length=128 --output_dir=/data/albert   # ALBERT pairs + masks
    tfbig-prep --format=bert --seq_length=128 --vocab_size=30522 --output_dir=/data/bert  # BERT: NSP + WWM
    tfbig-prep --format=bert --tokenizer=uncased_L-12_H-768_A-12/vocab.txt --output_dir=/data/bert
    tfbig-prep --input=my_text/ --tokenizer=runs/gpt2 --seq_length=512 --output_dir=/data/mine  # GPT-2's BPE
    tfbig-prep --format=completion --input=pairs.jsonl --tokenizer=Llama-3.2-1B/ --seq_length=512 \
        --output_dir=/data/pairs   # {"prompt": ..., "completion": ...} lines: fine-tuning data
    tfbig-prep --format=albert --index_shards='bert/*.tfrecord' --index_validation_shards=dev.tfrecord \
        --tokenizer=sp.model --output_dir=/data/bert   # shards of create_pretraining_data.py, as they are
    tfbig-prep --input='pile/train/*.jsonl.zst' --jsonl_group_field=meta.pile_set_name \
        --jsonl_groups=Pile-CC,Github --shard_by_group --output_dir=/data/pile   # streamed, per component
    tfbig-prep --input='enwiki-*-pages-articles*.xml*.bz2' --output_dir=/data/enwiki   # Wikipedia dumps
    tfbig-prep --input='/shared/pile/*.jsonl.zst' --output_dir=/shared/out --runner=direct --num_workers=4  # Beam
    tfbig-prep --flagfile=prep.flags

Every flag maps onto an argument of `tfbig.data.prepare`.
"""

import glob
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # console script: no C++ INFO lines

from absl import flags, logging  # noqa: E402

from tfbig.commands import cli  # noqa: E402
from tfbig.data import (DEFAULT_VALIDATION_PLAYS, FORMATS, index_shards,  # noqa: E402
                        load_tokenizer, prepare)
from tfbig.data.bert import BERT_MASKING  # noqa: E402
from tfbig.data.tokenizer import tokenizer_file  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("input", None, "Input files, directories (searched recursively for .txt/.md/.jsonl "
                          "and Wikipedia .xml dumps, plain or .gz/.bz2/.xz/.zst, streamed) or globs; repeat the "
                          "flag for several. Empty (and no --tfds_name): the embedded Shakespeare plays.")
flags.DEFINE_string("output_dir", None, "Directory for shards, tokenizer.model and manifest.json. Default for "
                    "the embedded corpus: $TFBIG_CACHE or ~/.cache/tfbig/shakespeare-T{seq_length}-V{vocab_size}.")
flags.DEFINE_enum("format", "gpt", sorted(FORMATS), "Record format of the shards (completion: "
                  ".jsonl prompt-completion pairs for causal-LM fine-tuning, the loss on the "
                  "completion; needs --tokenizer).")
flags.DEFINE_integer("seq_length", 1024, "Tokens per training example; each record holds seq_length + 1.")
flags.DEFINE_integer("vocab_size", 8000, "Vocabulary size of the tokenizer to train; with --tokenizer it "
                     "defaults to that tokenizer's size (and must match it if given).")
flags.DEFINE_string("tokenizer", None, "Existing SentencePiece .model file (with --format=bert: a WordPiece "
                    "vocab.txt, cased if it has upper-case pieces; with --format=gpt also GPT-2's byte-level "
                    "BPE vocab.json with merges.txt beside it, or a Hugging Face tokenizer.json: Llama 3, "
                    "Qwen, Mistral...) to use instead of training one, or a directory holding one (a "
                    "Hugging Face GPT-2 or Llama, a tfbig-convert output or tfbig-train run: the "
                    "tokenizer its config.json names); it is copied next to the shards.")
flags.DEFINE_float("shard_size_mb", 1024, "Target size of one shard file in MiB.")
flags.DEFINE_integer("num_workers", 1, "Processes that tokenize and write shards in parallel (with "
                     "--runner=direct: the DirectRunner's worker processes).")
flags.DEFINE_string("runner", "local", "local (--num_workers processes on this host) or an Apache Beam runner: "
                    "direct, dataflow, spark, flink, portable (the optional extra tfbig[beam]); same shards "
                    "and manifest. Beam workers must share --output_dir and the inputs (a shared file system).")
flags.DEFINE_list("beam_options", None, "Extra Apache Beam pipeline options for --runner other than local, "
                  "e.g. --beam_options=--project=p,--region=europe-west4,--temp_location=gs://b/tmp.")
flags.DEFINE_bool("doc_per_line", False, "In .txt/.md inputs, each non-empty line is a document "
                  "(default: each file is one document).")
flags.DEFINE_string("jsonl_field", "text", "Field of each .jsonl line that holds the document text "
                    "(--format=completion: the completion; default there 'completion').")
flags.DEFINE_string("prompt_field", "prompt", "--format=completion: field of each .jsonl line that "
                    "holds the prompt.")
flags.DEFINE_string("jsonl_group_field", None, "Dotted path of each .jsonl record's group, e.g. "
                    "'meta.pile_set_name' (the Pile's component); documents are counted per group in the manifest.")
flags.DEFINE_list("jsonl_groups", None, "Keep only these groups (e.g. 'Pile-CC,Github'); the documents of "
                  "other groups are skipped and counted. Needs --jsonl_group_field.")
flags.DEFINE_bool("shard_by_group", False, "Each shard holds one of --jsonl_groups (file names carry the group; "
                  "the manifest lists each shard's group), e.g. per-component shards of the Pile.")
flags.DEFINE_string("tfds_name", None, "TensorFlow Datasets dataset to read instead of files, e.g. "
                    "'my_corpus:1.0.0'. It must already be on disk: nothing is downloaded.")
flags.DEFINE_string("tfds_split", "train", "TFDS split to read.")
flags.DEFINE_string("tfds_validation_split", None, "TFDS split to validate on (e.g. 'validation'); "
                    "default: hold out --validation_fraction of --tfds_split.")
flags.DEFINE_string("tfds_text_key", "text", "TFDS feature holding the document text.")
flags.DEFINE_string("tfds_data_dir", None, "TFDS data_dir holding the prepared dataset (default: TFDS's own).")
flags.DEFINE_float("validation_fraction", 0.01, "Share of the input held out for validation, chosen as whole "
                   "files (or 1 MiB ranges of lines) spread evenly over the input. 0 = no validation split.")
flags.DEFINE_list("validation_plays", list(DEFAULT_VALIDATION_PLAYS), "Embedded corpus only: plays "
                  "held out for validation (file names without .md).")
flags.DEFINE_float("tokenizer_sample_mb", 512, "At most this much training text (MiB) trains the tokenizer.")
flags.DEFINE_bool("overwrite", False, "Replace a directory prepared with other settings instead of refusing.")
flags.DEFINE_integer("seed", 0, "Seed for tokenizer training (and ALBERT pairs and masks).")
# --format=albert and --format=bert (tfbig.data.MaskingOptions); recorded in the manifest.
flags.DEFINE_integer("max_predictions_per_seq", 20, "ALBERT: at most this many masked-LM "
                     "predictions per sequence.")
flags.DEFINE_float("masked_lm_prob", 0.15, "ALBERT: share of tokens to predict (80% [MASK], 10% "
                   "random, 10% kept).")
flags.DEFINE_integer("max_ngram", 3, "ALBERT: mask spans of 1..n tokens (or words), weighted 1/n; "
                     "1 = single tokens (the default of --format=bert).")
flags.DEFINE_bool("whole_word_masking", False, "ALBERT: mask whole words (all pieces of a word; for "
                  "--format=bert a piece and its ## continuations, on by default).")
flags.DEFINE_integer("dupe_factor", 1, "ALBERT: times each document is used, with other pairs and "
                     "masks (or train with --dynamic_masking).")
flags.DEFINE_float("short_seq_prob", 0.1, "ALBERT: share of documents packed to a random shorter "
                   "length.")
flags.DEFINE_list("index_shards", None, "ALBERT: instead of preparing text, write a manifest for these "
                  "existing standard-format shards (e.g. from tf-models-official's create_pretraining_data.py; "
                  "comma-separated files or globs) made with --tokenizer.")
flags.DEFINE_list("index_validation_shards", None, "ALBERT: validation shards for --index_shards.")
flags.DEFINE_float("copy_prob", 0.0, "ALBERT: share of pairs made copy pairs: segment A is a copy of "
                   "one line (>= 4 tokens) of segment B, B the pair's text around it in order "
                   "(sentence-order label 0), so the masked LM is rewarded for finding where A's words occur "
                   "in B, the match extractive QA needs (0: ALBERT's pairs only).")
_ALBERT_OPTIONS = ("max_predictions_per_seq", "masked_lm_prob", "max_ngram", "whole_word_masking",
                   "dupe_factor", "short_seq_prob", "copy_prob")


def main(argv: list[str]) -> None:
    """Run `prepare` with the flags and print where the manifest went."""
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; inputs go in --input")
    manifest = _index_from_flags() if FLAGS.index_shards else _prepare_from_flags()
    print(manifest.path)


def _index_from_flags():
    if FLAGS.format != "albert" or not FLAGS.tokenizer or not FLAGS.output_dir:
        raise ValueError("--index_shards needs --format=albert, --tokenizer (the SentencePiece model the "
                         "shards were made with) and --output_dir")
    return index_shards(_shard_files("index_shards"), _shard_files("index_validation_shards"),
                                    FLAGS.output_dir, FLAGS.tokenizer)


def _shard_files(flag):
    files = []
    for pattern in FLAGS[flag].value or ():
        found = sorted(glob.glob(pattern))
        if not found:
            raise ValueError(f"--{flag}: {pattern!r} matches no file")
        files += found
    return files


def _vocab_size() -> int:
    """--vocab_size, or the size of --tokenizer when only that is given."""
    if FLAGS.tokenizer and not FLAGS["vocab_size"].present:
        return load_tokenizer(tokenizer_file(FLAGS.tokenizer)).vocab_size
    return FLAGS.vocab_size


def _prepare_from_flags():
    return prepare(
        FLAGS.input, FLAGS.output_dir, FLAGS.seq_length, _vocab_size(), FLAGS.shard_size_mb,
        FLAGS.num_workers, FLAGS.format, tokenizer=FLAGS.tokenizer, doc_per_line=FLAGS.doc_per_line,
        jsonl_field=(FLAGS.jsonl_field if FLAGS["jsonl_field"].present or FLAGS.format != "completion"
                     else "completion"), prompt_field=FLAGS.prompt_field,
        jsonl_group_field=FLAGS.jsonl_group_field or "",
        jsonl_groups=tuple(FLAGS.jsonl_groups or ()), shard_by_group=FLAGS.shard_by_group,
        tfds_name=FLAGS.tfds_name or "", tfds_split=FLAGS.tfds_split,
        tfds_validation_split=FLAGS.tfds_validation_split or "", tfds_text_key=FLAGS.tfds_text_key,
        tfds_data_dir=FLAGS.tfds_data_dir,
        validation_fraction=FLAGS.validation_fraction, validation_plays=tuple(FLAGS.validation_plays),
        tokenizer_sample_mb=FLAGS.tokenizer_sample_mb, overwrite=FLAGS.overwrite, seed=FLAGS.seed,
        runner=FLAGS.runner, beam_options=tuple(FLAGS.beam_options or ()),
        format_options=_format_options())


def _format_options():
    """The masking flags of --format=albert|bert (bert's own defaults where a flag is not given)."""
    if FLAGS.format not in ("albert", "bert"):
        return None
    options = {name: FLAGS[name].value for name in _ALBERT_OPTIONS}
    if FLAGS.format == "bert" and options["copy_prob"]:
        raise UsageError(f"--copy_prob={options['copy_prob']}: copy pairs are made for --format=albert only")
    if FLAGS.format == "bert":
        options.update({name: value for name, value in BERT_MASKING.items() if not FLAGS[name].present})
    return options


def run() -> None:
    """Console-script entry point (`tfbig-prep`)."""
    logging.set_verbosity(logging.INFO)
    albert = list(_ALBERT_OPTIONS) + ["index_shards", "index_validation_shards"]
    cli.run_app("tfbig-prep", main, __doc__, [("prep", cli.own_flags(exclude=albert)),
                                              ("albert and bert (--format=albert|bert)", albert)])


if __name__ == "__main__":
    run()
