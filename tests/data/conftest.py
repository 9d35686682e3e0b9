"""Shared fixtures for data tests: a small generated corpus and directories prepared from it.

Session-scoped fixtures are read-only; a test that damages a directory copies it first.
"""
import os
import random
import shutil

import pytest

from tfbig.data import prepare

WORDS = ("the king queen crown sword night day love death honour my lord lady fair good sweet "
         "speak hear come go stay heaven earth fortune villain friend noble gentle father son "
         "daughter brother sister world time heart eye hand blood grace war peace").split()
SEQ_LENGTH = 16
VOCAB_SIZE = 400


def make_document(rng: random.Random, num_lines: int) -> str:
    """A play-like document: a speaker line then verse lines, with a little Unicode."""
    lines = []
    for _ in range(num_lines):
        if rng.random() < 0.2:
            lines.append(rng.choice(WORDS).upper())
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", "; café —", " ½"]))
    return "\n".join(lines) + "\n"


def write_corpus(directory, num_files: int, lines_per_file: int, seed: int = 0) -> list[str]:
    """`num_files` one-document .txt files; returns their paths in sorted order."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for index in range(num_files):
        path = os.path.join(directory, f"doc{index:03d}.txt")
        with open(path, "w", encoding="utf-8") as file:
            file.write(make_document(rng, lines_per_file))
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def document_maker():
    """`make_document` for tests in other modules (conftest is not importable by name)."""
    return make_document


@pytest.fixture(scope="session")
def corpus_writer():
    """`write_corpus` for tests in other modules."""
    return write_corpus


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """12 documents of ~4 KB."""
    directory = tmp_path_factory.mktemp("corpus")
    write_corpus(directory, num_files=12, lines_per_file=80)
    return str(directory)


@pytest.fixture(scope="session")
def multi_shard_dir(tmp_path_factory, corpus_dir):
    """Several train shards (by-file sharding) and a validation split."""
    output = str(tmp_path_factory.mktemp("multi"))
    prepare([corpus_dir], output, SEQ_LENGTH, VOCAB_SIZE, shard_size_mb=0.006, num_workers=1,
            validation_fraction=0.2)
    return output


@pytest.fixture(scope="session")
def single_shard_dir(tmp_path_factory, corpus_dir):
    """One train shard (by-record sharding for 2+ pipelines)."""
    output = str(tmp_path_factory.mktemp("single"))
    prepare([corpus_dir], output, SEQ_LENGTH, VOCAB_SIZE, shard_size_mb=64, num_workers=1,
            validation_fraction=0.2)
    return output


@pytest.fixture
def copy_of(tmp_path):
    """Copy a prepared directory so a test may damage it."""
    def copy(source: str) -> str:
        target = str(tmp_path / "copy")
        shutil.copytree(source, target)
        return target
    return copy
