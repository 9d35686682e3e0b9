"""Shared test set-up: quiet TensorFlow logs, fp32 policy restored after each test."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_process_state():
    """Process-wide TF/Keras settings a test changes (mixed precision policy, op determinism
    from --deterministic runs) must not leak into the tests after it."""
    yield
    keras.mixed_precision.set_global_policy("float32")
    from tensorflow.python.framework import config as op_config

    op_config.disable_op_determinism()


def _synthetic_corpus(directory, num_docs=60, seed=0):
    """Small play-like documents with learnable structure (speaker lines, repeated verse)."""
    import random

    rng = random.Random(seed)
    speakers = ["ROMEO", "JULIET", "NURSE", "MERCUTIO", "TYBALT"]
    words = ("love night light sweet death fair heaven wherefore art thou star moon speak "
             "sword blood name rose honour house gentle good noble").split()
    os.makedirs(directory, exist_ok=True)
    for d in range(num_docs):
        lines = []
        for _ in range(rng.randint(6, 14)):
            lines.append(rng.choice(speakers))
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 9))) + ".")
        with open(os.path.join(directory, f"doc{d:03d}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return directory


PLAYS = ("hamlet", "macbeth", "othello", "twelfth-night")  # twelfth-night: a validation play


@pytest.fixture(scope="session")
def scenes():
    """Scenes of a few embedded plays, as tfbig-prep's documents."""
    from tfbig.data import sources

    texts = []
    for path in sources.shakespeare_plays():
        if sources.play_name(path) in PLAYS:
            with open(path, encoding="utf-8") as file:
                texts += sources.play_scenes(file.read())
    return texts


@pytest.fixture(scope="session")
def scene_files(tmp_path_factory, scenes):
    """The scenes as text files, one per scene (a file is a document for tfbig-prep)."""
    root = tmp_path_factory.mktemp("scenes")
    for index, scene in enumerate(scenes):
        (root / f"scene{index:03d}.txt").write_text(scene, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """A tiny prepared GPT dataset: real TFRecord shards, manifest and tokenizer (seq 16)."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("gpt_data")
    corpus = _synthetic_corpus(str(root / "text"))
    out = str(root / "shards")
    prepare([corpus], out, seq_length=16, vocab_size=320, shard_size_mb=0.01,
            validation_fraction=0.2)
    return out


@pytest.fixture(scope="session")
def albert_data(tmp_path_factory):
    """A tiny prepared ALBERT dataset (standard BERT/ALBERT features, seq 32).

    Every sequence is full length and has exactly 2 masked predictions: the MLM loss is a mean
    over each replica's predictions (as in tf-models-official), which equals the mean over the
    global batch only when replicas hold equally many, so distributed runs can be compared
    with one device exactly."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("albert_data")
    corpus = _synthetic_corpus(str(root / "text"))
    out = str(root / "shards")
    prepare([corpus], out, seq_length=32, vocab_size=320, shard_size_mb=0.01,
            validation_fraction=0.2, format="albert",
            format_options={"max_predictions_per_seq": 2, "short_seq_prob": 0.0,
                            "dupe_factor": 2})
    return out


@pytest.fixture(scope="session")
def bert_data(tmp_path_factory):
    """A tiny prepared BERT dataset (WordPiece vocab trained on it, NSP pairs, seq 32).

    Every sequence has exactly 2 single-token predictions (masked_lm_prob 0.5 of at least 5
    tokens, capped at 2), so each replica's MLM mean equals the global one (see albert_data)."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("bert_data")
    corpus = _synthetic_corpus(str(root / "text"))
    out = str(root / "shards")
    prepare([corpus], out, seq_length=32, vocab_size=320, shard_size_mb=0.01,
            validation_fraction=0.2, format="bert",
            format_options={"max_predictions_per_seq": 2, "masked_lm_prob": 0.5,
                            "whole_word_masking": False, "short_seq_prob": 0.0,
                            "dupe_factor": 2})
    return out
