"""TFDS input: a real (tiny) dataset built on disk with tensorflow_datasets, read by name."""
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tfbig.data import make_dataset
from tfbig.data import prepare
from tfbig.data import Tokenizer

NUM_EXAMPLES = 40


class TinyPlays(tfds.core.GeneratorBasedBuilder):
    """40 short documents in a "train" split and 4 in "test"."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = tfds.features.FeaturesDict({"body": tfds.features.Text(), "index": tf.int64})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(NUM_EXAMPLES), "test": self._generate_examples(4)}

    def _generate_examples(self, count):
        for index in range(count):
            text = f"DOCUMENT {index}\n" + " ".join(f"word{index * 7 % 13} line{index}" for _ in range(40))
            yield index, {"body": text, "index": index}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tfds"))
    TinyPlays(data_dir=directory).download_and_prepare()
    return directory


def test_prepare_reads_a_tfds_dataset_on_disk(tfds_dir, tmp_path):
    manifest = prepare(output_dir=str(tmp_path / "out"), seq_length=16, vocab_size=300, shard_size_mb=0.004,
                       tfds_name="tiny_plays", tfds_split="train", tfds_validation_split="test",
                       tfds_text_key="body", tfds_data_dir=tfds_dir)
    assert manifest.info["source"] == "tfds:tiny_plays[train].body"
    assert manifest.split("validation").records > 0
    tokenizer = Tokenizer.load(manifest.tokenizer_path)
    builder = tfds.builder("tiny_plays", data_dir=tfds_dir)
    longest = int(tokenizer.piece_byte_lengths().max())
    for split, tfds_split, count in (("train", "train", NUM_EXAMPLES), ("validation", "test", 4)):
        ids = np.concatenate([batch["input_ids"].numpy().reshape(-1) for batch in
                              make_dataset(manifest.data_dir, split, 1, shuffle=False, repeat=False)])
        text = tokenizer.decode(np.where(ids == tokenizer.eos_id, tokenizer.piece_id("\n"), ids))
        seen = {int(line.split()[1]) for line in text.split("\n") if line.startswith("DOCUMENT")}
        assert seen == set(range(count))  # every example, once: the dropped tail is < 17 tokens
        expected_bytes = sum(len(ex["body"]) for ex in tfds.as_numpy(builder.as_dataset(split=tfds_split)))
        assert expected_bytes - 16 * longest <= manifest.split(split).bytes <= expected_bytes


def test_tfds_errors_name_the_flag(tfds_dir, tmp_path):
    common = dict(output_dir=str(tmp_path / "out"), seq_length=16, vocab_size=300, tfds_data_dir=tfds_dir)
    with pytest.raises(ValueError, match=r"--tfds_split='validation'.*\['test', 'train'\]"):
        prepare(tfds_name="tiny_plays", tfds_split="validation", tfds_text_key="body", **common)
    with pytest.raises(ValueError, match=r"--tfds_name='no_such_dataset'"):
        prepare(tfds_name="no_such_dataset", **common)
    with pytest.raises(ValueError, match=r"--tfds_validation_split='dev'.*\['test', 'train'\]"):
        prepare(tfds_name="tiny_plays", tfds_validation_split="dev", tfds_text_key="body", **common)
    with pytest.raises(ValueError, match=r"--tfds_text_key='text'.*\['body', 'index'\]"):
        prepare(tfds_name="tiny_plays", tfds_validation_split="test", **common)
    with pytest.raises(ValueError, match=r"--validation_fraction=0.1 leaves no training data.*only 1 piece"):
        prepare(tfds_name="tiny_plays", tfds_text_key="body", validation_fraction=0.1, **common)
