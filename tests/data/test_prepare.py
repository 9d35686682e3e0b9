"""prepare() / tfbig-prep end to end: round trip, resume, refusals, bad input, CLI, embedded corpus."""
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tfbig.data import make_dataset
from tfbig.data import load_manifest
from tfbig.data import default_data_dir, prepare
from tfbig.data import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, VOCAB = 16, 400


def _rows(data_dir: str, split: str) -> np.ndarray:
    """All records of a split in manifest order, through make_dataset."""
    dataset = make_dataset(data_dir, split, 1, shuffle=False, repeat=False, drop_remainder=False)
    return np.concatenate([batch["input_ids"].numpy() for batch in dataset])


def _snapshot(directory: str) -> dict:
    return {name: (os.stat(os.path.join(directory, name)).st_mtime_ns,
                   open(os.path.join(directory, name), "rb").read()) for name in sorted(os.listdir(directory))}


def test_round_trip_text_to_batches_is_exact(multi_shard_dir, corpus_dir):
    manifest = load_manifest(multi_shard_dir)
    tokenizer = Tokenizer.load(manifest.tokenizer_path)
    byte_lengths = tokenizer.piece_byte_lengths()
    docs = [open(os.path.join(corpus_dir, name), encoding="utf-8").read() for name in sorted(os.listdir(corpus_dir))]
    encoded = [tokenizer.encode(doc) + [tokenizer.eos_id] for doc in docs]
    assert len(manifest.split("train").shards) >= 3
    used = []
    for split in ("train", "validation"):
        rows, offset = _rows(multi_shard_dir, split), 0
        assert rows.shape == (manifest.split(split).records, SEQ + 1) and rows.dtype == np.int32
        for shard in manifest.split(split).shards:
            stream = rows[offset:offset + shard.records].reshape(-1).tolist()
            offset += shard.records
            # A shard starts at a document boundary and holds whole documents, minus a dropped tail.
            first = next(i for i, ids in enumerate(encoded) if stream[:len(ids)] == ids[:len(stream)])
            position, index = 0, first
            while position < len(stream):  # documents follow in input order; the other split's are skipped
                ids = encoded[index]
                if stream[position:position + len(ids)] == ids[:len(stream) - position]:
                    used.append(index)
                    position += len(ids)
                index += 1
            assert position - len(stream) <= SEQ  # only a partial record was dropped
            if len(encoded[first]) <= len(stream):
                assert tokenizer.decode(stream[:len(encoded[first]) - 1]) == docs[first]
            assert (shard.tokens, shard.bytes) == (len(stream), byte_lengths[stream].sum())
    assert sorted(used) == list(range(len(docs)))  # every document once, train and validation disjoint


def _prepare(inputs, output, **overrides):
    settings = dict(seq_length=SEQ, vocab_size=VOCAB, shard_size_mb=0.006, num_workers=1, validation_fraction=0.2)
    return prepare(inputs, output, **{**settings, **overrides})


def test_resume_rewrites_only_what_is_missing(tmp_path, corpus_dir):
    output = str(tmp_path / "out")
    manifest = _prepare([corpus_dir], output, num_workers=2)
    reference, (_, missing, damaged) = manifest.to_json(), manifest.shard_paths("train")[:3]
    before = _snapshot(output)
    os.remove(os.path.join(output, "manifest.json"))  # crashed before the manifest ...
    os.remove(missing)  # ... with a shard unfinished
    with open(missing + ".tmp", "wb") as file:
        file.write(b"partial")
    with open(damaged, "r+b") as file:
        file.seek(100)
        file.write(b"\x00\x01\x02")
    time.sleep(0.01)
    assert _prepare([corpus_dir], output, num_workers=2).to_json() == reference
    after = _snapshot(output)
    assert sorted(after) == sorted(before)  # the .tmp is gone, nothing else appeared
    rewritten = {name for name in before if after[name][0] != before[name][0]}
    assert {name for name in rewritten if name.endswith(".tfrecord")} == {
        os.path.basename(missing), os.path.basename(damaged)}
    assert all(after[name][1] == before[name][1] for name in before if name != "manifest.json")


def test_second_run_reuses_everything_and_matches_a_fresh_run(tmp_path, corpus_dir, multi_shard_dir):
    fresh = _prepare([corpus_dir], str(tmp_path / "fresh")).to_json()
    assert fresh == load_manifest(multi_shard_dir).to_json()  # deterministic output
    before = _snapshot(str(tmp_path / "fresh"))
    _prepare([corpus_dir], str(tmp_path / "fresh"))
    assert _snapshot(str(tmp_path / "fresh")) == before


def test_refuses_other_settings_and_keeps_everything(tmp_path, corpus_dir, document_maker):
    output = str(tmp_path / "out")
    _prepare([corpus_dir], output)
    before = _snapshot(output)
    with pytest.raises(ValueError, match=r"seq_length=16 .*manifest\.json.* seq_length=32 was requested"):
        _prepare([corpus_dir], output, seq_length=32)
    with pytest.raises(ValueError, match=r"vocab_size=400.*vocab_size=500"):
        _prepare([corpus_dir], output, vocab_size=500)
    with pytest.raises(ValueError, match=r"shard_size_mb"):
        _prepare([corpus_dir], output, shard_size_mb=64)
    other = str(tmp_path / "other.model")
    Tokenizer.train([document_maker(random.Random(9), 100) for _ in range(5)], VOCAB, str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"tokenizer of sha256 .*other\.model has sha256"):
        _prepare([corpus_dir], output, tokenizer=other)
    assert _snapshot(output) == before


def test_refuses_a_crashed_directory_from_other_settings(tmp_path, corpus_dir):
    output = str(tmp_path / "out")
    _prepare([corpus_dir], output)
    os.remove(os.path.join(output, "manifest.json"))  # only shards and .done sidecars are left
    with pytest.raises(ValueError, match=r"seq_length=16 \(see train-00000-of-\d{5}\.tfrecord\.done\)"):
        _prepare([corpus_dir], output, seq_length=8)


def test_overwrite_replaces_and_removes_stale_shards(tmp_path, corpus_dir):
    output = str(tmp_path / "out")
    _prepare([corpus_dir], output)
    manifest = _prepare([corpus_dir], output, seq_length=8, shard_size_mb=64, overwrite=True)
    assert manifest.seq_length == 8 and len(manifest.split("train").shards) == 1
    shard_files = sorted(name for name in os.listdir(output) if ".tfrecord" in name)
    assert shard_files == ["train-00000-of-00001.tfrecord", "train-00000-of-00001.tfrecord.done",
                           "validation-00000-of-00001.tfrecord", "validation-00000-of-00001.tfrecord.done"]
    assert _rows(output, "train").shape == (manifest.split("train").records, 9)


def test_given_tokenizer_is_copied_and_checked(tmp_path, corpus_dir, multi_shard_dir):
    source = os.path.join(multi_shard_dir, "tokenizer.model")
    manifest = _prepare([corpus_dir], str(tmp_path / "out"), tokenizer=source)
    assert open(manifest.tokenizer_path, "rb").read() == open(source, "rb").read()
    assert manifest.to_json()["splits"] == load_manifest(multi_shard_dir).to_json()["splits"]
    with pytest.raises(ValueError, match=r"tokenizer.model has vocab_size=400 but --vocab_size=512"):
        _prepare([corpus_dir], str(tmp_path / "out2"), tokenizer=source, vocab_size=512)


def test_bad_input(tmp_path, corpus_writer):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match=r"input .*empty.* is empty"):
        _prepare([str(tmp_path / "empty")], str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"--input '.*missing' matches no files"):
        _prepare([str(tmp_path / "missing")], str(tmp_path / "out"))
    paths = corpus_writer(tmp_path / "bad", num_files=4, lines_per_file=60)
    with open(paths[1], "ab") as file:
        file.write(b"broken \xff\xfe\xfd bytes\n")
    manifest = _prepare([str(tmp_path / "bad")], str(tmp_path / "out"), validation_fraction=0.25)
    assert manifest.info["replaced_chars"] == 3
    assert manifest.info["replaced_chars_by_file"] == {paths[1]: 3}


def test_worker_errors_reach_the_caller_and_name_the_file(tmp_path, multi_shard_dir):
    lines = [json.dumps({"text": f"the king {i} " * 40}) for i in range(1000)]  # ~430 KB
    lines[900] = json.dumps({"body": "no text field here"})  # past the sample prep reads itself
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"a\.jsonl: line 901 \(byte \d+\): no string field 'text'"):
        _prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "out"), num_workers=2, shard_size_mb=0.05,
                 validation_fraction=0, tokenizer=os.path.join(multi_shard_dir, "tokenizer.model"))
    assert any(name.endswith(".done") for name in os.listdir(tmp_path / "out"))  # other shards finished
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_embedded_default_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("TFBIG_CACHE", str(tmp_path / "cache"))
    manifest = prepare(seq_length=64, vocab_size=1000, num_workers=2)
    assert manifest.data_dir == default_data_dir(64, 1000) == str(tmp_path / "cache" / "shakespeare-T64-V1000")
    validation, train = manifest.split("validation"), manifest.split("train")
    assert 0.05 < validation.bytes / (train.bytes + validation.bytes) < 0.15  # three plays of 38
    assert 2.0 < train.bytes / train.tokens < 4.0  # a 1000-token BPE on English verse
    tokenizer = Tokenizer.load(manifest.tokenizer_path)
    text = tokenizer.decode(_rows(manifest.data_dir, "validation").reshape(-1))
    assert "MALVOLIO\n" in text and "CORIOLANUS\n" in text and "SCENE II." in text
    assert not any(mark in text for mark in ("**", "#", "_", "\\["))
    train_text = tokenizer.decode(next(iter(make_dataset(manifest.data_dir, "train", 64)))["input_ids"].numpy().reshape(-1))
    assert "MALVOLIO" not in train_text and "\n" in train_text
    # the second call reads the cache: every file stays as the first call wrote it (a check of
    # what was done, not of how long it took: a wall-time bound fails on a busy machine)
    written = {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(manifest.data_dir, "**"),
                                                              recursive=True)}
    assert prepare(seq_length=64, vocab_size=1000).to_json() == manifest.to_json()
    assert {p: os.stat(p).st_mtime_ns for p in written} == written
    assert sorted(glob.glob(os.path.join(manifest.data_dir, "**"), recursive=True)) == \
        sorted(written)


def test_cli_with_flagfile_and_clear_errors(tmp_path, corpus_dir, multi_shard_dir):
    flagfile = tmp_path / "prep.flags"
    flagfile.write_text(f"--input={corpus_dir}\n--output_dir={tmp_path / 'out'}\n--seq_length={SEQ}\n"
                        f"--vocab_size={VOCAB}\n--shard_size_mb=0.006\n--validation_fraction=0.2\n--num_workers=2\n")
    command = [sys.executable, "-m", "data_prep.prep", f"--flagfile={flagfile}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "out" / "manifest.json")
    assert load_manifest(str(tmp_path / "out")).splits == load_manifest(multi_shard_dir).splits
    refused = subprocess.run(command + ["--seq_length=32"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "tfbig-prep: error:" in refused.stderr and "seq_length=32 was requested" in refused.stderr
    assert "Traceback" not in refused.stderr
    with_tokenizer = subprocess.run(  # --vocab_size defaults to the given tokenizer's
        [sys.executable, "-m", "data_prep.prep", f"--input={corpus_dir}", f"--output_dir={tmp_path / 'tok'}",
         f"--tokenizer={os.path.join(multi_shard_dir, 'tokenizer.model')}", "--validation_fraction=0.2"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert with_tokenizer.returncode == 0, with_tokenizer.stderr
    assert load_manifest(str(tmp_path / "tok")).vocab_size == VOCAB
    help_text = subprocess.run([sys.executable, "-m", "data_prep.prep", "--helpfull"], cwd=REPO,
                               capture_output=True, text=True, timeout=120).stdout
    for flag in ("input", "output_dir", "seq_length", "vocab_size", "tokenizer", "shard_size_mb", "num_workers",
                 "doc_per_line", "jsonl_field", "tfds_name", "tfds_data_dir", "validation_fraction", "overwrite"):
        assert f"--{flag}" in help_text or f"--[no]{flag}" in help_text


@pytest.mark.slow  # kills a prep run mid-write and resumes it (two prep runs); what a resume rewrites: test_resume_rewrites_only_what_is_missing (default)
def test_killed_run_resumes_to_identical_output(tmp_path):
    """SIGKILL a real tfbig-prep process mid-run, rerun, compare with an uninterrupted run."""
    flags = ["--seq_length=64", "--vocab_size=1000", "--shard_size_mb=0.03", "--num_workers=1"]
    killed = str(tmp_path / "killed")
    process = subprocess.Popen([sys.executable, "-m", "data_prep.prep", f"--output_dir={killed}", *flags],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        done = [n for n in os.listdir(killed) if n.endswith(".done")] if os.path.isdir(killed) else []
        if len(done) >= 3:
            break
        time.sleep(0.005)
    process.kill()
    process.wait()
    assert not os.path.exists(os.path.join(killed, "manifest.json")), "the run ended before it could be killed"
    survivors = {n: os.stat(os.path.join(killed, n[:-5])).st_mtime_ns
                 for n in os.listdir(killed) if n.endswith(".done")}
    resumed = prepare(None, killed, 64, 1000, 0.03).to_json()
    assert resumed == prepare(None, str(tmp_path / "clean"), 64, 1000, 0.03).to_json()
    assert {n: os.stat(os.path.join(killed, n[:-5])).st_mtime_ns for n in survivors} == survivors
    assert not [n for n in os.listdir(killed) if n.endswith(".tmp")]


def test_embedded_cache_from_an_older_recipe_is_rebuilt_a_users_directory_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TFBIG_CACHE", str(tmp_path / "cache"))
    manifest = prepare(seq_length=32, vocab_size=600)
    path = os.path.join(manifest.data_dir, "manifest.json")
    with open(path) as f:
        content = json.load(f)
    content["info"]["prep_key"] = "made-by-an-older-tfbig"
    with open(path, "w") as f:
        json.dump(content, f)
    users = str(tmp_path / "mine")
    shutil.copytree(manifest.data_dir, users)
    with pytest.raises(ValueError, match="choose another --output_dir or pass --overwrite"):
        prepare(None, users, seq_length=32, vocab_size=600)
    rebuilt = prepare(seq_length=32, vocab_size=600)  # tfbig's own cache: rebuilt, no flag
    assert rebuilt.info["prep_key"] == manifest.info["prep_key"]
