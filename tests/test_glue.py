"""tfbig-classify --tfds_name=glue/*: GLUE tasks written on disk by TFDS's own GLUE builder
(its download replaced by local files in GLUE's layout), read back by name from the data dir:
texts in GLUE's order, ClassLabel names, mnli's matched/mismatched validation splits, scores
per split; unprepared datasets, unlabelled splits and wrong features are errors."""
import csv
import json

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.text import glue as tfds_glue

from test_classify import WORDS, bert_run  # noqa: F401 (a fixture)
from tfbig.data import glue
from tfbig.commands.classify import ClassifyOptions, fine_tune
from tfbig.errors import UsageError

MNLI_LABELS = ["entailment", "neutral", "contradiction"]


class _LocalFiles:
    """The one download-manager call GLUE's builder makes: the extracted archive is `root`."""

    def __init__(self, root):
        self.root = root

    def download_and_extract(self, url):
        return self.root


class LocalGlue(tfds_glue.Glue, skip_registration=True):
    """TFDS's GLUE builder (same name, configs, features, splits and TSV parsing), reading
    GLUE's files from a local directory instead of downloading them."""

    name = "glue"

    def __init__(self, *, files, **kwargs):
        self.files = files
        super().__init__(**kwargs)

    def _split_generators(self, dl_manager):
        return super()._split_generators(_LocalFiles(self.files))


def _write_tsv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n")
        writer.writerows([header, *rows])


def _pairs(count, seed):
    """MNLI rows (sentence1, sentence2, gold_label); the label is set by a key word."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        label = int(rng.integers(0, 3))
        premise = " ".join([["yes", "no", "the"][label], *rng.choice(WORDS, 5)])
        rows.append((premise, " ".join(rng.choice(WORDS, 4)), MNLI_LABELS[label]))
    return rows


@pytest.fixture(scope="module")
def glue_data(tmp_path_factory):
    """{name: rows} of glue/mnli and glue/sst2 prepared by TFDS in a temporary data dir."""
    root = tmp_path_factory.mktemp("glue")
    files, data_dir = root / "files", str(root / "tfds")
    mnli = {"train": _pairs(24, 0), "dev_matched": _pairs(6, 1),
            "dev_mismatched": _pairs(5, 2)}
    for name, rows in mnli.items():
        _write_tsv(files / "MNLI" / f"{name}.tsv", ["sentence1", "sentence2", "gold_label"], rows)
    for name in ("test_matched", "test_mismatched"):  # GLUE's test labels are private
        _write_tsv(files / "MNLI" / f"{name}.tsv", ["sentence1", "sentence2"], [("a", "b")])
    sst2 = {"train": [(" ".join(WORDS[i:i + 4]), str(i % 2)) for i in range(8)],
            "dev": [("cat sat", "1"), ("dog ran", "0")]}
    for name, rows in sst2.items():
        _write_tsv(files / "SST-2" / f"{name}.tsv", ["sentence", "label"], rows)
    _write_tsv(files / "SST-2" / "test.tsv", ["index", "sentence"], [("0", "a cat")])
    tfds.disable_progress_bar()
    for config in ("mnli", "sst2"):
        LocalGlue(files=str(files), config=config, data_dir=data_dir).download_and_prepare()
    return data_dir, mnli, sst2


def _options(data_dir, name, **kwargs):
    return ClassifyOptions(tfds_name=name, tfds_data_dir=data_dir, **kwargs)


def test_mnli_pairs_labels_and_matched_mismatched_splits(glue_data):
    data_dir, mnli, _ = glue_data
    builder = tfds.builder("glue/mnli", data_dir=data_dir)
    assert type(builder) is tfds_glue.Glue and builder.is_prepared()  # TFDS's own, by name
    train, evals, names = glue.read_tfds(_options(data_dir, "glue/mnli"))
    assert names == MNLI_LABELS  # the ClassLabel's order, not sorted
    assert sorted(evals) == ["validation_matched", "validation_mismatched"]
    # every example once, premise first (TFDS stores a split in its own shuffled order), with
    # GLUE's index of its row (TFDS's idx feature)
    assert sorted(e[:3] for e in train) == sorted(mnli["train"])
    assert sorted(e[3] for e in train) == list(range(len(mnli["train"])))
    assert sorted(e[:3] for e in evals["validation_matched"]) == sorted(mnli["dev_matched"])
    assert sorted(e[:3] for e in evals["validation_mismatched"]) == sorted(mnli["dev_mismatched"])
    only = glue.read_tfds(_options(data_dir, "glue/mnli", tfds_eval_splits="validation_mismatched",
                                   text_a="hypothesis", text_b="premise"))
    assert list(only[1]) == ["validation_mismatched"]
    assert sorted(e[:3] for e in only[0]) == sorted((b, a, label) for a, b, label in mnli["train"])


def test_sst2_single_sentences(glue_data):
    data_dir, _, sst2 = glue_data
    train, evals, names = glue.read_tfds(_options(data_dir, "glue/sst2"))
    assert names == ["negative", "positive"] and list(evals) == ["validation"]
    assert sorted(e[:3] for e in train) == sorted((text, None, names[int(label)])
                                                  for text, label in sst2["train"])
    assert sorted(evals["validation"]) == [("cat sat", None, "positive", 0),
                                           ("dog ran", None, "negative", 1)]


def test_fine_tune_on_tfds_scores_each_validation_split(glue_data, bert_run, tmp_path):  # noqa: F811
    data_dir, mnli, _ = glue_data
    out = tmp_path / "out"
    result = fine_tune(_options(data_dir, "glue/mnli", init_checkpoint=str(bert_run / "run"),
                                output_dir=str(out), max_seq_length=16, train_batch_size=8,
                                max_steps=3, xla=False))
    assert json.loads((out / "eval_results.json").read_text()) == result
    assert json.loads((out / "labels.json").read_text()) == MNLI_LABELS
    for split, tsv in (("validation_matched", "dev_matched"),
                       ("validation_mismatched", "dev_mismatched")):
        rows = [json.loads(line) for line in
                (out / f"predictions_{split}.jsonl").read_text().splitlines()]
        predicted = [row["label"] for row in rows]
        stored = tfds.builder("glue/mnli", data_dir=data_dir).as_dataset(split=split,
                                                                         shuffle_files=False)
        truth = [MNLI_LABELS[row["label"]] for row in tfds.as_numpy(stored)]  # TFDS's order
        # each prediction carries its example's GLUE index (what a submission is keyed on)
        assert [row["idx"] for row in rows] == [int(row["idx"]) for row in tfds.as_numpy(stored)]
        assert sorted(row["idx"] for row in rows) == list(range(len(rows)))
        assert sorted(truth) == sorted(label for *_, label in mnli[tsv])
        assert len(predicted) == len(truth) and set(predicted) <= set(MNLI_LABELS)
        assert result[f"{split}/accuracy"] == pytest.approx(
            np.mean(np.array(predicted) == np.array(truth)))
        assert 0.0 <= result[f"{split}/f1"] <= 1.0


def test_tfds_errors_name_the_flag_and_directory(glue_data, tmp_path):
    data_dir, _, _ = glue_data
    empty = str(tmp_path / "empty")
    with pytest.raises(UsageError, match=rf"'glue/mnli' is not prepared in {empty}/glue/mnli/"
                                         r".*never downloads.*--tfds_data_dir"):
        glue.read_tfds(_options(empty, "glue/mnli"))
    with pytest.raises(UsageError, match=r"--tfds_name='no_such_set': cannot open it"):
        glue.read_tfds(_options(data_dir, "no_such_set"))
    with pytest.raises(UsageError, match=r"glue/mnli/2.0.0\[test_matched\] has label -1"):
        glue.read_tfds(_options(data_dir, "glue/mnli", tfds_eval_splits="test_matched"))
    with pytest.raises(UsageError, match=r"--tfds_eval_splits='validation': glue/mnli/2.0.0 "
                                         r"has splits \['test_matched'.*not \['validation'\]"):
        glue.read_tfds(_options(data_dir, "glue/mnli", tfds_eval_splits="validation"))
    with pytest.raises(UsageError, match=r"--label='idx': .* must be a ClassLabel \(got Tensor"):
        glue.read_tfds(_options(data_dir, "glue/sst2", label="idx"))
    with pytest.raises(UsageError, match=r"--text_a='question'.*\['hypothesis', 'idx'"):
        glue.read_tfds(_options(data_dir, "glue/mnli", text_a="question"))
    with pytest.raises(UsageError, match=r"--tfds_split='dev'.*has splits"):
        glue.read_tfds(_options(data_dir, "glue/sst2", tfds_split="dev"))
    with pytest.raises(UsageError, match=r"--tfds_name=glue/sst2 and --train_file=train.tsv: "
                                         "give one source"):
        fine_tune(_options(data_dir, "glue/sst2", train_file="train.tsv"))
    with pytest.raises(UsageError, match=r"no training examples: give --train_file"):
        fine_tune(ClassifyOptions())
