"""--format=completion: prompt-completion JSONL for causal-LM fine-tuning (tfbig.data.completion),
the loss on the completion tokens only.

tfbig-prep writes one row per record (prompt ids, completion ids, end-of-document, padded) and
a loss mask; both equal a reference built here from the tokenizer's own ids. The task's loss
equals the mean cross-entropy of the completion targets computed by hand from the model's
logits, per batch and per sequence (validation); a tiny Llama and a tiny GPT fine-tuned on the
pairs lower it (slow: two short trainings)."""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfbig.data import load_manifest, load_tokenizer, prepare

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_prep_llama_tokenizers import _byte_level_tokenizer_json  # noqa: E402
from test_trainer import make_cfg  # noqa: E402

SEQ = 24
NAMES = ["Romeo", "Juliet", "Nurse", "Tybalt", "Mercutio", "Benvolio", "Paris", "Capulet"]


def _pairs(count=96):
    """Questions whose answers are a function of the question (learnable in a few steps)."""
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(count):
        a, b = rng.choice(NAMES, 2, replace=False)
        pairs.append({"prompt": f"Who loves {a}? ", "completion": f"{a} loves {b}."})
    pairs.append({"prompt": "A prompt far too long to leave room: " * 6, "completion": "lost"})
    pairs.append({"prompt": "", "completion": "No prompt at all."})
    return pairs


@pytest.fixture(scope="module")
def completions(tmp_path_factory):
    """(input .jsonl, tokenizer directory, prepared data directory)."""
    root = tmp_path_factory.mktemp("completion")
    pairs = _pairs()
    source = root / "pairs.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    lines = [p["prompt"] + p["completion"] for p in pairs] * 4
    _byte_level_tokenizer_json(lines, checkpoint / "tokenizer.json")
    tokenizer = load_tokenizer(str(checkpoint / "tokenizer.json"))
    prepare([str(source)], str(root / "data"), seq_length=SEQ, vocab_size=tokenizer.vocab_size,
            format="completion", tokenizer=str(checkpoint), jsonl_field="completion",
            validation_fraction=0.2)
    return source, checkpoint, root / "data", pairs


def _rows(manifest, split):
    spec = {"input_ids": tf.io.FixedLenFeature([SEQ + 1], tf.int64),
            "loss_mask": tf.io.FixedLenFeature([SEQ], tf.int64)}
    rows = []
    for path in manifest.shard_paths(split):
        records = tf.data.TFRecordDataset(path).batch(1 << 16).get_single_element()
        parsed = tf.io.parse_example(records, spec)
        rows += list(zip(parsed["input_ids"].numpy(), parsed["loss_mask"].numpy()))
    return rows


def _reference(prompt, completion, eos):
    """Row and mask of one pair, written out position by position."""
    ids = (prompt + completion + [eos])[:SEQ + 1]
    row = ids + [eos] * (SEQ + 1 - len(ids))
    mask = [1 if len(prompt) <= t + 1 < len(ids) else 0 for t in range(SEQ)]
    return row, mask


def test_rows_and_loss_masks_equal_the_reference(completions):
    _, checkpoint, data, pairs = completions
    manifest = load_manifest(str(data))
    assert manifest.format == "completion" and manifest.tokenizer == "tokenizer.json"
    tokenizer = load_tokenizer(str(checkpoint / "tokenizer.json"))
    eos = tokenizer.eos_id
    expected = []
    for p in pairs:
        prompt, completion = tokenizer.encode(p["prompt"]), tokenizer.encode(p["completion"])
        if len(prompt) < SEQ:  # the too-long prompt leaves no completion target: left out
            row, mask = _reference(prompt, completion, eos)
            expected.append((tuple(row), tuple(mask)))
    rows = _rows(manifest, "train") + _rows(manifest, "validation")
    written = [(tuple(row.tolist()), tuple(mask.tolist())) for row, mask in rows]
    assert len(written) == len(pairs) - 1 > 90
    assert sorted(written) == sorted(expected)
    assert all(sum(mask) > 0 for _, mask in written)
    # the empty prompt: every target but the unpredictable first token counts
    empty = tokenizer.encode("No prompt at all.")
    row, mask = _reference([], empty, eos)
    assert sum(mask) == len(empty) and (tuple(row), tuple(mask)) in written


def _finetune(data, tmp_path, model):
    from tfbig.training.trainer import Trainer

    cfg = make_cfg(str(data), tmp_path / model, model=model, seq_length=SEQ, max_steps=12,
                   learning_rate=2e-2, warmup_steps=2, batch_size=8, eval_steps=1)
    return Trainer(cfg)


def _by_hand(model, batch):
    """(mean cross-entropy of the completion targets, of the prompt targets) from the logits."""
    logits = model(batch["input_ids"][:, :-1]).numpy().astype(np.float64)
    targets, mask = batch["input_ids"][:, 1:].numpy(), batch["loss_mask"].numpy()
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # (B, T)
    prompt = np.zeros_like(mask)  # the prompt's targets: before the first completion target
    for row, first in enumerate(mask.argmax(axis=1)):
        prompt[row, :first] = 1
    return (picked * mask).sum() / mask.sum(), (picked * prompt).sum() / prompt.sum()


def test_the_task_loss_is_the_mean_over_completion_targets(completions, tmp_path):
    from tfbig.tasks import get_task

    _, _, data, _ = completions
    cfg = make_cfg(str(data), tmp_path, model="llama", seq_length=SEQ)
    task = get_task(cfg.train, cfg)
    assert task.format == "completion" and task.model_format == "llama"
    model = task.build_model()
    batch = next(iter(task.dataset("train", 8, shuffle=False, repeat=False)))
    mask = batch["loss_mask"].numpy()
    assert 0 < mask.sum() < mask.size // 2  # prompts and padding are left out
    completion, _ = _by_hand(model, batch)
    loss, _ = task.loss(model, batch)
    assert float(loss) == pytest.approx(completion, rel=1e-5)
    per_sequence = task.validation_step(model, batch)["loss"].numpy()
    for row in range(len(mask)):
        one = {k: v[row:row + 1] for k, v in batch.items()}
        assert per_sequence[row] == pytest.approx(_by_hand(model, one)[0], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_fine_tuning_on_completions_lowers_their_loss(completions, tmp_path, model):
    _, _, data, _ = completions
    trainer = _finetune(data, tmp_path, model)
    assert trainer.task.format == "completion"
    batch = next(iter(trainer.task.dataset("train", 8, shuffle=False, repeat=False)))
    first = trainer.evaluate()["loss"]
    summary = trainer.fit()
    assert summary["eval"]["loss"] < first - 0.5, (first, summary["eval"])
    completion, prompt = _by_hand(trainer.model, batch)
    assert float(trainer.task.loss(trainer.model, batch)[0]) == pytest.approx(completion,
                                                                              rel=1e-5)
    assert completion < prompt - 0.5  # trained on the completions, not on the prompts
    saved = json.loads((tmp_path / model / "config.json").read_text())
    assert saved["model_format"] == model


def test_completion_input_is_refused_where_it_cannot_work(completions, tmp_path):
    source, checkpoint, _, _ = completions
    with pytest.raises(ValueError, match="--format=completion: pass --tokenizer"):
        prepare([str(source)], str(tmp_path / "a"), seq_length=SEQ, format="completion",
                jsonl_field="completion")
    text = tmp_path / "plain.txt"
    text.write_text("some text\n" * 20)
    with pytest.raises(ValueError, match=r"plain\.txt is not a \.jsonl file"):
        prepare([str(text)], str(tmp_path / "b"), seq_length=SEQ, format="completion",
                tokenizer=str(checkpoint), vocab_size=load_tokenizer(
                    str(checkpoint / "tokenizer.json")).vocab_size)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "completion": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 1 .*no string field 'prompt' "
                                         r"\(found \['completion', 'question'\]\); set "
                                         r"--prompt_field"):
        prepare([str(bad)], str(tmp_path / "c"), seq_length=SEQ, format="completion",
                tokenizer=str(checkpoint), jsonl_field="completion", validation_fraction=0,
                vocab_size=load_tokenizer(str(checkpoint / "tokenizer.json")).vocab_size)
    for name in ("a", "b", "c"):
        assert not (tmp_path / name / "manifest.json").exists()
