"""ALBERT data: masking statistics, sentence-order pairs, standard-format shards (ours and
tf-models-official's create_pretraining_data.py), dynamic masking."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfbig import data
from tfbig.data import albert as albert_data, index, tfrecord
from tfbig.data import MaskingOptions, MaskingVocab
from tfbig.tasks.masked_lm import DynamicMasking, _restore


def instances(tokenizer, scenes, seq_length=128, **options):
    """All instances of the scenes as one {feature: (N, width)} dict."""
    documents = [tokenizer.encode(scene) for scene in scenes]
    batches = list(albert_data.albert_examples(documents, seq_length, tokenizer, seed=0,
                                               **options))
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}


def predicted(batch):
    """(row, position) of every real prediction."""
    rows, slots = np.nonzero(batch["masked_lm_weights"] > 0)
    return rows, batch["masked_lm_positions"][rows, slots], batch["masked_lm_ids"][rows, slots]


def check_masking_statistics(batch, vocab, masked_lm_prob=0.15):
    rows, positions, labels = predicted(batch)
    lengths = batch["input_mask"].sum(axis=1)
    share = np.bincount(rows, minlength=len(lengths)) / lengths
    assert abs(share.mean() - masked_lm_prob) < 0.006, share.mean()
    shown = batch["input_ids"][rows, positions]
    is_mask = shown == vocab.mask_id
    kept = shown == labels
    assert abs(is_mask.mean() - 0.8) < 0.01, is_mask.mean()
    assert abs(kept.mean() - 0.1) < 0.01, kept.mean()
    assert abs((~is_mask & ~kept).mean() - 0.1) < 0.01  # random replacements
    special = np.isin(labels, [vocab.cls_id, vocab.sep_id]) | (batch["input_mask"][rows, positions] == 0)
    assert not special.any()  # never [CLS], [SEP] or padding
    unmasked = np.ones(batch["input_ids"].shape, bool)
    unmasked[rows, positions] = False
    return len(labels)


def test_token_masking_is_15_percent_80_10_10(albert_tokenizer, scenes):
    batch = instances(albert_tokenizer, scenes, max_ngram=1, max_predictions_per_seq=40,
                      dupe_factor=2)
    count = check_masking_statistics(batch, MaskingVocab.from_tokenizer(albert_tokenizer))
    assert len(batch["input_ids"]) > 3000 and count > 50000  # a large sample


def test_max_predictions_per_seq_caps_and_pads(albert_tokenizer, scenes):
    batch = instances(albert_tokenizer, scenes[:10], max_predictions_per_seq=7)
    weights = batch["masked_lm_weights"]
    assert weights.shape[1] == 7 and weights.sum(axis=1).max() == 7
    padded = weights == 0
    assert (batch["masked_lm_positions"][padded] == 0).all()
    assert (batch["masked_lm_ids"][padded] == 0).all()
    real = np.where(padded, 10**6, batch["masked_lm_positions"])
    assert (np.diff(real, axis=1)[~padded[:, 1:]] > 0).all()  # sorted, no repeats


def test_ngram_masking_masks_spans(albert_tokenizer, scenes):
    batch = instances(albert_tokenizer, scenes[:40], max_ngram=3, max_predictions_per_seq=40)
    rows, positions, _ = predicted(batch)
    runs = []
    for row in np.unique(rows):
        chosen = np.sort(positions[rows == row])
        runs += [len(run) for run in np.split(chosen, np.flatnonzero(np.diff(chosen) > 1) + 1)]
    assert np.mean(np.array(runs) >= 2) > 0.3  # 1/n weights: ~45% of spans are 2- or 3-grams
    check_masking_statistics(batch, MaskingVocab.from_tokenizer(albert_tokenizer), 0.148)


def test_whole_word_masking_masks_every_piece_of_a_word(albert_tokenizer, scenes):
    vocab = MaskingVocab.from_tokenizer(albert_tokenizer)
    batch = instances(albert_tokenizer, scenes[:30], whole_word_masking=True, max_ngram=1,
                      max_predictions_per_seq=40)
    restored = _restore({k: tf.constant(v) for k, v in batch.items()}).numpy()
    multi_piece = 0
    for row in range(len(restored)):
        chosen = set(predicted({k: v[row:row + 1] for k, v in batch.items()})[1].tolist())
        tokens = restored[row, :batch["input_mask"][row].sum()]
        word = np.cumsum(vocab.word_starts(tokens))
        for w in np.unique(word[list(chosen)]):
            members = set(np.flatnonzero(word == w).tolist()) - set(
                np.flatnonzero(np.isin(tokens, [vocab.cls_id, vocab.sep_id])).tolist())
            assert members <= chosen, (row, members - chosen)
            multi_piece += len(members) > 1
    assert multi_piece > 100  # the rule was exercised on words of several pieces


def starts(ids, part):
    """Every start of `part` as a contiguous slice of `ids`."""
    windows = np.lib.stride_tricks.sliding_window_view(ids, len(part))
    return np.flatnonzero((windows == part).all(axis=1))


def test_sentence_order_pairs_are_balanced_and_in_document_order(albert_tokenizer, scenes):
    rng = np.random.default_rng(0)
    labels = []
    for scene in scenes:
        ids = np.array(albert_tokenizer.encode(scene))
        segments = albert_data.split_segments(ids, albert_tokenizer.piece_id("\n"))
        for a, b, swapped in albert_data.sentence_order_pairs(segments, 125, rng):
            assert len(a) + len(b) <= 125 and len(a) and len(b)
            first, second = (b, a) if swapped else (a, b)  # the document's order
            ends_first = starts(ids, first) + len(first)
            assert len(ends_first) and (starts(ids, second)[:, None] >= ends_first).any()
            labels.append(swapped)
    assert len(labels) > 1500
    assert abs(np.mean(labels) - 0.5) < 0.03


def test_static_features_match_the_standard_format(albert_tokenizer, scenes):
    batch = instances(albert_tokenizer, scenes[:3], seq_length=64, max_predictions_per_seq=9)
    vocab = MaskingVocab.from_tokenizer(albert_tokenizer)
    assert set(batch) == set(albert_data.FEATURES)
    assert batch["next_sentence_labels"].shape == (len(batch["input_ids"]), 1)
    for row in range(len(batch["input_ids"])):
        n = batch["input_mask"][row].sum()
        assert (batch["input_mask"][row, :n] == 1).all() and (batch["input_ids"][row, n:] == 0).all()
        seps = np.flatnonzero(batch["input_ids"][row] == vocab.sep_id)
        assert batch["input_ids"][row, 0] == vocab.cls_id and seps[-1] == n - 1
        assert (batch["segment_ids"][row, :seps[0] + 1] == 0).all()
        assert (batch["segment_ids"][row, seps[0] + 1:n] == 1).all()


def test_prepared_shards_round_trip_through_the_reader(albert_data_dir, albert_tokenizer, scenes):
    dataset = data.make_dataset(albert_data_dir, "train", 16, format="albert", seq_length=64,
                                shuffle=False, repeat=False, drop_remainder=False)
    corpus = "".join(scenes)
    rows = 0
    for batch in dataset:
        assert batch["masked_lm_positions"].shape[1] == 12 and batch["input_ids"].dtype == tf.int32
        original = _restore(batch).numpy()
        for row, segment_ids in zip(original, batch["segment_ids"].numpy()):
            for segment in (0, 1):  # A and B decode to text of the corpus (after unmasking)
                ids = row[(segment_ids == segment) & (row > 5)]  # drop [CLS]/[SEP]/padding
                assert albert_tokenizer.decode(ids) in corpus
        rows += len(original)
    from tfbig.data import load_manifest
    assert rows == load_manifest(albert_data_dir).split("train").records > 100


def test_our_encoding_equals_tensorflows_example_parser(albert_tokenizer, scenes, tmp_path):
    batch = instances(albert_tokenizer, scenes[:2], seq_length=64)
    path = str(tmp_path / "x.tfrecord")
    with tfrecord.RecordWriter(path) as writer:
        writer.write(tfrecord.encode_examples(batch))
    spec = {name: tf.io.FixedLenFeature([length], tf.int64 if dtype == "int64" else tf.float32)
            for name, (dtype, length) in albert_data.albert_features(64, 20).items()}
    for i, record in enumerate(tf.data.TFRecordDataset(path)):
        parsed = tf.io.parse_single_example(record, spec)
        for name in albert_data.FEATURES:
            np.testing.assert_array_equal(parsed[name].numpy(), batch[name][i])


@pytest.fixture(scope="module")
def official_shards(tmp_path_factory, albert_tokenizer, scenes):
    """Shards written by tf-models-official's own create_pretraining_data.py (SentencePiece)."""
    root = tmp_path_factory.mktemp("official")
    # Its input: one sentence per line, a blank line between documents.
    text = "\n\n".join("\n".join(line for line in scene.split("\n") if line.strip())
                       for scene in scenes[:12])
    (root / "input.txt").write_text(text + "\n", encoding="utf-8")
    paths = [str(root / "train.tfrecord"), str(root / "validation.tfrecord")]  # round robin
    subprocess.run([sys.executable, "-m", "official.nlp.data.create_pretraining_data",
                    f"--input_file={root / 'input.txt'}", f"--output_file={','.join(paths)}",
                    "--tokenization=SentencePiece", f"--sp_model_file={albert_tokenizer.path}",
                    "--nodo_lower_case", "--max_seq_length=64", "--max_predictions_per_seq=10",
                    "--dupe_factor=1", "--random_seed=1"],
                   check=True, capture_output=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    out = str(root / "indexed")
    manifest = index.index_shards([paths[0]], [paths[1]], out, albert_tokenizer.path)
    return out, paths, manifest


def test_shards_of_the_official_tool_are_read_as_they_are(official_shards):
    out, paths, manifest = official_shards
    assert (manifest.seq_length, manifest.info["format_options"]) == (64, {"max_predictions_per_seq": 10})
    spec = {name: tf.io.FixedLenFeature([length], tf.int64 if dtype == "int64" else tf.float32)
            for name, (dtype, length) in albert_data.albert_features(64, 10).items()}
    expected = [tf.io.parse_single_example(r, spec) for r in tf.data.TFRecordDataset(paths[0])]
    dataset = data.make_dataset(out, "train", 1, format="albert", seq_length=64, shuffle=False,
                                repeat=False)
    read = list(dataset)
    assert len(read) == len(expected) == manifest.split("train").records > 20
    for ours, theirs in zip(read, expected):
        for name in albert_data.FEATURES:
            np.testing.assert_array_equal(ours[name][0].numpy(), theirs[name].numpy())


def test_a_shard_with_v2_feature_names_is_a_clear_error(albert_tokenizer, tmp_path):
    path = str(tmp_path / "v2.tfrecord")
    with tfrecord.RecordWriter(path) as writer:
        writer.write(tfrecord.encode_examples({"input_word_ids": np.ones((1, 8), np.int64)}))
    with pytest.raises(ValueError, match="lacks feature.*use_v2_feature_names"):
        index.index_shards([path], [], str(tmp_path / "out"), albert_tokenizer.path)


def test_dynamic_masking_statistics_and_determinism(albert_data_dir, albert_tokenizer):
    vocab = MaskingVocab.from_tokenizer(albert_tokenizer)
    masking = DynamicMasking(vocab, 0.15, 12)
    dataset = data.make_dataset(albert_data_dir, "train", 64, format="albert", seq_length=64,
                                shuffle=False, repeat=False)
    outputs = []
    for i, batch in enumerate(dataset):
        out = masking(batch, tf.constant([7, i], tf.int64))
        np.testing.assert_array_equal(_restore(out).numpy(), _restore(batch).numpy())
        outputs.append({k: v.numpy() for k, v in out.items()})
    joined = {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]}
    check_masking_statistics(joined, vocab, 0.15)
    first = next(iter(dataset))
    again = masking(first, tf.constant([7, 0], tf.int64))["masked_lm_positions"].numpy()
    other = masking(first, tf.constant([8, 0], tf.int64))["masked_lm_positions"].numpy()
    np.testing.assert_array_equal(again, outputs[0]["masked_lm_positions"])  # same seed, same masks
    assert (other != again).any()


def test_masking_options_are_checked():
    with pytest.raises(ValueError, match="--masked_lm_prob=1.5"):
        MaskingOptions(masked_lm_prob=1.5)
    with pytest.raises(ValueError, match="--max_predictions_per_seq=0"):
        MaskingOptions(max_predictions_per_seq=0)


def copy_rows(batch, vocab):
    """Rows whose segment A (unmasked) is one line, without its newline, of segment B."""
    restored = _restore({k: tf.constant(v) for k, v in batch.items()}).numpy()
    rows = []
    for row in range(len(restored)):
        seps = np.flatnonzero(restored[row] == vocab.sep_id)
        a, b = restored[row, 1:seps[0]], restored[row, seps[0] + 1:seps[1]]
        if vocab.newline_id not in a and len(a) <= len(b) and len(starts(b, a)):
            rows.append(row)
    return np.array(rows, dtype=np.int64)


def test_copy_pairs_put_a_line_of_b_in_a(albert_tokenizer, scenes):
    vocab = MaskingVocab.from_tokenizer(albert_tokenizer)
    plain = instances(albert_tokenizer, scenes[:40])
    assert len(copy_rows(plain, vocab)) < 0.02 * len(plain["input_ids"])  # ALBERT's pairs
    batch = instances(albert_tokenizer, scenes[:40], copy_prob=0.5)
    rows = copy_rows(batch, vocab)
    assert 0.4 < len(rows) / len(batch["input_ids"]) < 0.55, len(rows) / len(batch["input_ids"])
    assert (batch["next_sentence_labels"][rows] == 0).all()  # in order: A is a line of B
    restored = _restore({k: tf.constant(v) for k, v in batch.items()}).numpy()
    newline = albert_tokenizer.piece_id("\n")
    for row in rows[:200]:
        seps = np.flatnonzero(restored[row] == vocab.sep_id)
        a, b = restored[row, 1:seps[0]], restored[row, seps[0] + 1:seps[1]]
        at = starts(b, a)[0]
        assert len(a) >= albert_data.COPY_MIN_TOKENS and newline not in a  # one whole line
        assert at == 0 or b[at - 1] == newline
    predicted_in_a = sum(((batch["masked_lm_positions"][row] > 0) &
                          (batch["masked_lm_positions"][row] < np.flatnonzero(
                              batch["input_ids"][row] == vocab.sep_id)[0])).sum() for row in rows)
    assert predicted_in_a > 0.05 * len(rows)  # the copy is masked like any other text
    check_masking_statistics(batch, vocab)


def test_copy_prob_is_checked(albert_tokenizer, scenes):
    with pytest.raises(ValueError, match="--copy_prob=1.5"):
        MaskingOptions(copy_prob=1.5)
    from tfbig.data import bert as bert_data

    with pytest.raises(ValueError, match="--copy_prob=0.5.*--format=albert"):
        next(bert_data.bert_examples([albert_tokenizer.encode(scenes[0])], 64, albert_tokenizer,
                                     copy_prob=0.5))


@pytest.mark.slow  # a whole tfbig-prep run; copy pairs themselves: test_copy_pairs_put_a_line_of_b_in_a (default)
def test_prep_copy_prob_flag_writes_copy_pairs(albert_tokenizer, scene_files, tmp_path):
    """tfbig-prep --copy_prob: recorded in the manifest, copy pairs in the shards; refused for
    --format=bert; without it the manifest is as before (no copy_prob key)."""
    from tfbig.data import load_manifest, prepare

    out = tmp_path / "copy"
    done = subprocess.run([sys.executable, "-m", "data_prep.prep", "--format=albert",
                           f"--input={scene_files}", f"--tokenizer={albert_tokenizer.path}",
                           "--seq_length=64", "--validation_fraction=0.2",
                           "--max_predictions_per_seq=10", "--copy_prob=0.5",
                           f"--output_dir={out}"], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    assert load_manifest(str(out)).info["format_options"]["copy_prob"] == 0.5
    dataset = data.make_dataset(str(out), "train", 64, format="albert", seq_length=64,
                                shuffle=False, repeat=False)
    batch = {k: np.concatenate([b[k].numpy() for b in dataset]) for k in albert_data.FEATURES}
    share = len(copy_rows(batch, MaskingVocab.from_tokenizer(albert_tokenizer))) / len(
        batch["input_ids"])
    assert 0.35 < share < 0.55, share
    plain = prepare([str(scene_files)], str(tmp_path / "plain"), seq_length=64, vocab_size=1000,
                    tokenizer=albert_tokenizer.path, validation_fraction=0.2, format="albert",
                    format_options={"max_predictions_per_seq": 10, "copy_prob": 0.0})
    assert plain.info["format_options"] == {"max_predictions_per_seq": 10}  # as before the flag
    # the CLI in its own process: data_prep.prep's absl flags clash with other scripts' flags
    # (data_prep.shakespeare_qa's --output_dir) once both are imported into one test session
    refused = subprocess.run([sys.executable, "-m", "data_prep.prep", "--format=bert",
                              f"--input={scene_files}", "--copy_prob=0.5",
                              f"--output_dir={tmp_path / 'bert'}"], capture_output=True,
                             text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert refused.returncode != 0
    assert re.search(r"--copy_prob=0.5: .*--format=albert only", refused.stderr), refused.stderr
    assert not (tmp_path / "bert" / "manifest.json").exists()
