"""Weighted mixtures of prepared directories: proportions, exact resume, per-source counts, errors."""
import math
import os

import numpy as np
import pytest

from tfbig.data import make_dataset, open_manifest, prepare, source_counts, source_tokens

SEQ, VOCAB = 16, 400
WEIGHTS = (0.7, 0.3)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, corpus_writer, multi_shard_dir):
    """Two directories prepared from different text with the same tokenizer."""
    tokenizer = os.path.join(multi_shard_dir, "tokenizer.model")
    dirs = []
    for index, name in enumerate(("books", "web")):
        root = tmp_path_factory.mktemp(name)
        corpus_writer(root / "text", num_files=6, lines_per_file=60, seed=10 + index)
        dirs.append(str(prepare([str(root / "text")], str(root / name), SEQ, VOCAB, shard_size_mb=0.004,
                                tokenizer=tokenizer, validation_fraction=0.2).data_dir))
    return dirs


def _spec(dirs, weights=WEIGHTS):
    return ",".join(f"{d}:{w}" for d, w in zip(dirs, weights))


def _records(data_dir):
    """Every train record of one directory, as row tuples."""
    dataset = make_dataset(data_dir, "train", 1, shuffle=False, repeat=False, drop_remainder=False)
    return {tuple(row) for batch in dataset for row in batch["input_ids"].numpy()}


def _rows(spec, num_batches, batch_size=8, **kwargs):
    dataset = make_dataset(spec, "train", batch_size, seed=3, deterministic=True, **kwargs)
    return np.concatenate([batch["input_ids"].numpy() for _, batch in zip(range(num_batches), dataset)])


def test_observed_proportions_match_the_weights(sources):
    owner = {}
    for index, data_dir in enumerate(sources):
        for row in _records(data_dir):
            assert owner.setdefault(row, index) == index  # every record names its source
    rows = _rows(_spec(sources), 250)  # 2000 examples
    observed = np.bincount([owner[tuple(row)] for row in rows], minlength=2)
    n = len(rows)
    for count, p in zip(observed, WEIGHTS):
        tolerance = 4 * math.sqrt(p * (1 - p) / n)  # 4 binomial standard deviations (~0.041 here)
        assert abs(count / n - p) <= tolerance, (observed, tolerance)
    # The counter-based choices the resume relies on say the same.
    np.testing.assert_array_equal(observed, source_counts(np.array(WEIGHTS), 3, n))


def test_resumed_mixture_continues_every_source_exactly(sources):
    spec = _spec(sources)
    straight = _rows(spec, 40)
    resumed = _rows(spec, 25, skip_batches=15)
    np.testing.assert_array_equal(resumed, straight[15 * 8:])
    # Across a choice-block boundary (4096 examples) too.
    across = _rows(spec, 2, batch_size=512, skip_batches=7)
    np.testing.assert_array_equal(across[:512], _rows(spec, 8, batch_size=512)[7 * 512:])


def test_mixture_file_validation_split_and_token_counts(sources, tmp_path):
    mixture_file = tmp_path / "mix.txt"
    mixture_file.write_text(f"# books and web\n{sources[0]}:7\n\n{sources[1]}:3  # less web\n")
    np.testing.assert_array_equal(_rows(str(mixture_file), 5), _rows(_spec(sources), 5))
    manifest = open_manifest(str(mixture_file))
    singles = [open_manifest(d) for d in sources]
    assert manifest.split("validation").records == sum(m.split("validation").records for m in singles)
    validation = make_dataset(str(mixture_file), "validation", 1, shuffle=False, repeat=False)
    assert sum(1 for _ in validation) == manifest.split("validation").records
    counts = source_counts(np.array([0.7, 0.3]), 3, 1000)
    tokens = source_tokens(str(mixture_file), 3, 1000)  # 1000 global examples
    assert tokens == {f"tokens/{os.path.basename(d)}": float(c * (SEQ + 1)) for d, c in zip(sources, counts)}
    assert source_tokens(sources[0], 3, 1000) == {}


def test_bad_mixtures_are_refused_with_the_item(sources, tmp_path, corpus_writer):
    with pytest.raises(ValueError, match=r"'.*books:-1' is not 'directory:weight' with a positive weight"):
        open_manifest(f"{sources[0]}:-1,{sources[1]}:1")
    other = prepare([corpus_writer(tmp_path / "t", 4, 40, seed=5)[0]], str(tmp_path / "other"), SEQ, 450,
                    shard_size_mb=1, validation_fraction=0).data_dir
    with pytest.raises(ValueError, match=r"other has vocab_size=450 but .*books has 400; a mixture's sources must"):
        open_manifest(f"{sources[0]}:1,{other}:1")


@pytest.mark.slow  # three trainings; the mixture's resumed order: test_resumed_mixture_continues_every_source_exactly (default)
def test_training_on_a_mixture_resumes_exactly_and_logs_tokens_per_source(gpt_data, corpus_writer, tmp_path):
    from tfbig.config import ExperimentConfig
    from tfbig.training.trainer import Trainer

    def make_cfg(data_dir, model_dir, max_steps):
        cfg = ExperimentConfig()
        for key, value in dict(data_dir=data_dir, model_dir=str(model_dir), preset="tiny", seq_length=16,
                               num_layers=2, hidden_size=32, num_heads=4, dropout=0.1, batch_size=8,
                               max_steps=max_steps, learning_rate=3e-3, warmup_steps=2, log_every=1,
                               checkpoint_every=1000, eval_steps=2, deterministic=True, sample_tokens=0,
                               xla=False).items():
            setattr(cfg.train, key, value)
        return cfg

    corpus_writer(tmp_path / "text", num_files=6, lines_per_file=60, seed=7)
    other = prepare([str(tmp_path / "text")], str(tmp_path / "other"), 16, 320, shard_size_mb=0.01,
                    tokenizer=os.path.join(gpt_data, "tokenizer.model"), validation_fraction=0.2).data_dir
    spec = f"{gpt_data}:0.5,{other}:0.5"
    straight = Trainer(make_cfg(spec, tmp_path / "straight", max_steps=6))
    summary = straight.fit()
    Trainer(make_cfg(spec, tmp_path / "resumed", max_steps=3)).fit()
    second = Trainer(make_cfg(spec, tmp_path / "resumed", max_steps=6))
    resumed = second.fit()
    assert resumed["train"]["loss"] == pytest.approx(summary["train"]["loss"], rel=1e-6)
    for a, b in zip(straight.model.trainable_variables, second.model.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    counts = source_counts(np.array([0.5, 0.5]), 0, 6 * 8)
    assert {k: v for k, v in summary["train"].items() if k.startswith("tokens/")} == {
        "tokens/shards": counts[0] * 17.0, "tokens/other": counts[1] * 17.0}
    assert "bits_per_byte" in summary["eval"]  # the validation split of both sources


def test_groups_of_one_prep_are_weighted_as_sources(tmp_path, document_maker, multi_shard_dir):
    import json
    import random

    rng = random.Random(1)
    lines = [json.dumps({"text": document_maker(rng, 5), "meta": {"pile_set_name": ("Pile-CC", "Github")[i % 2]}})
             for i in range(80)]
    (tmp_path / "pile.jsonl").write_text("\n".join(lines) + "\n")
    pile = prepare([str(tmp_path / "pile.jsonl")], str(tmp_path / "pile"), SEQ, VOCAB, shard_size_mb=64,
                   tokenizer=os.path.join(multi_shard_dir, "tokenizer.model"), validation_fraction=0,
                   jsonl_group_field="meta.pile_set_name", jsonl_groups=("Pile-CC", "Github"), shard_by_group=True)
    owner = {}
    for index, group in enumerate(("Pile-CC", "Github")):
        for shard in pile.split("train").of_group(group).shards:
            dataset = make_dataset(f"{pile.data_dir}[{group}]:1", "train", 1, shuffle=False, repeat=True)
            for batch, _ in zip(dataset, range(shard.records)):
                owner[tuple(batch["input_ids"].numpy()[0])] = index
    spec = f"{pile.data_dir}[Pile-CC]:0.8,{pile.data_dir}[Github]:0.2"
    rows = _rows(spec, 100)
    observed = np.bincount([owner[tuple(row)] for row in rows], minlength=2)
    np.testing.assert_array_equal(observed, source_counts(np.array([0.8, 0.2]), 3, len(rows)))
    assert abs(observed[0] / len(rows) - 0.8) <= 4 * math.sqrt(0.8 * 0.2 / len(rows))
    assert set(source_tokens(spec, 3, 100)) == {"tokens/pile-cc", "tokens/github"}
    with pytest.raises(ValueError, match=r"pile\[Books3\]: .* has no shards of group 'Books3'; its groups are "
                                         r"\['Github', 'Pile-CC'\]"):
        open_manifest(f"{pile.data_dir}[Books3]:1")


def test_input_pipelines_read_their_slices_of_the_one_mixture_stream(sources):
    import tensorflow as tf

    spec = _spec(sources)
    per_pipeline = [_rows(spec, 30, batch_size=4, input_context=tf.distribute.InputContext(2, i, 1))
                    for i in range(2)]
    one = _rows(spec, 30)  # global batches of 8
    for step in range(30):  # every source's position is exact in each slice of the one order
        np.testing.assert_array_equal(np.concatenate([rows[step * 4:(step + 1) * 4] for rows in per_pipeline]),
                                      one[step * 8:(step + 1) * 8])
    # Resumed as two pipelines at global example 40: the examples of the straight run.
    resumed = [_rows(spec, 10, batch_size=4, start=40, input_context=tf.distribute.InputContext(2, i, 1))
               for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([rows[:4] for rows in resumed]), one[40:48])
