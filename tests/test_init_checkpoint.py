"""tfbig-train --init_checkpoint: pretraining continues from a converted model's weights.

The first step's loss equals the loss of the converted model itself (loaded as tfbig-generate
loads it, or built from its config.json) on the same batch; the optimizer and the step start
fresh; a resume wins over --init_checkpoint; flags, layouts and data that disagree with the
checkpoint are refused before anything is built.
"""
import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfbig.convert import init_checkpoint
from tfbig.checkpoints.checkpoint import model_variables
from tfbig.config import ExperimentConfig
from tfbig.convert import run_dir
from tfbig.data import load_manifest
from tfbig.data.bpe import ByteLevelBPE
from tfbig.data.tokenizer import for_run
from tfbig.errors import UsageError
from tfbig.convert.run_dir import load_model
from tfbig.tasks.gpt import GPTTask
from tfbig.training.trainer import Trainer


def _cfg(**train):
    cfg = ExperimentConfig()
    values = dict(model="gpt", seq_length=16, batch_size=4, max_steps=3, xla=False,
                  sample_tokens=0, dropout=0.0, deterministic=True, log_every=1, eval_steps=1,
                  warmup_steps=1, checkpoint_every=100)
    for key, value in {**values, **train}.items():
        setattr(cfg.train, key, value)
    return cfg


def _first_step_loss_and_reference(trainer, reference):
    """(the trainer's first step's loss, `reference` model's loss on the same batch)."""
    batch = {k: v[0] for k, v in next(trainer._train_iterator()).items()}  # accumulation 1
    expected, _ = trainer.task.loss(reference, batch)
    summary = trainer.fit(steps=1)
    return summary["train"]["loss"], float(expected)


def test_gpt2_continues_from_its_converted_weights(gpt2_bpe, tmp_path):
    run, model_dir = gpt2_bpe["run"], str(tmp_path / "continued")
    cfg = _cfg(init_checkpoint=run, data_dir=gpt2_bpe["data"], model_dir=model_dir)
    trainer = Trainer(cfg)
    converted_config, _ = run_dir.read_config(run, families=("gpt",))
    assert trainer.model.config == dataclasses.replace(converted_config, dropout=0.0)
    converted = run_dir.read_weights(run)
    ours = {k: v.numpy() for k, v in model_variables(trainer.model).items()}
    assert sorted(ours) == sorted(converted)
    assert all(np.array_equal(ours[k], converted[k]) for k in ours)
    assert int(trainer.step.numpy()) == 0 and int(trainer.optimizer.iterations.numpy()) == 0
    reference, _ = load_model(run)  # the converted GPT-2 as tfbig-generate loads it
    loss, expected = _first_step_loss_and_reference(trainer, reference)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    # the run carries GPT-2's tokenizer, so tfbig-generate and the exports read it
    tokenizer = for_run(model_dir)
    assert isinstance(tokenizer, ByteLevelBPE) and tokenizer.vocab_size == gpt2_bpe["vocab_size"]
    # the same command again resumes: its step and its own weights, not the converted ones
    again = Trainer(cfg)
    assert again.restored_from and int(again.step.numpy()) == 1
    kernel = model_variables(again.model)["block_0/attn/qkv/kernel"].numpy()
    assert not np.array_equal(kernel, converted["block_0/attn/qkv/kernel"])
    np.testing.assert_array_equal(kernel, model_variables(trainer.model)[
        "block_0/attn/qkv/kernel"].numpy())
    # ... but not with another --init_checkpoint (or none where one started it)
    with pytest.raises(UsageError, match=r"continued holds a checkpoint of a run started from "
                                         r"--init_checkpoint=.*run .*not from --init_checkpoint"
                                         r"=.*elsewhere"):
        init_checkpoint.apply(again.task, _cfg(init_checkpoint=str(tmp_path / "elsewhere"),
                                               data_dir=gpt2_bpe["data"], model_dir=model_dir))


def test_disagreeing_flags_layouts_and_data_are_refused(gpt2_bpe, gpt_data, tmp_path):
    run = gpt2_bpe["run"]

    def refused(match, data_dir=gpt2_bpe["data"], parallel=None, pipeline=None, **train):
        cfg = _cfg(**{"init_checkpoint": run, "model_dir": str(tmp_path / "m"), **train},
                   data_dir=data_dir)
        for key, value in (parallel or {}).items():
            setattr(cfg.parallel, key, value)
        for key, value in (pipeline or {}).items():
            setattr(cfg.pipeline, key, value)
        task = GPTTask(init_checkpoint.task_inputs(cfg.train, cfg)[0])
        before = task.model_config
        with pytest.raises(UsageError, match=match):
            init_checkpoint.apply(task, cfg)
        assert task.model_config is before

    refused(r"holds a gpt model \(.*config\.json: model_format\) but --model=albert; give "
            r"--model=gpt", model="albert")
    refused(r"--num_layers=3 disagrees with --init_checkpoint=.*run: .*config\.json has "
            r"num_layers=2; drop --num_layers", num_layers=3)
    refused(r"--preset=tiny has no effect with --init_checkpoint", preset="tiny")
    refused(r"--data_dir=.* does not fit --init_checkpoint=.*run: the data's vocab_size=320 "
            r"differs .*tfbig-prep --tokenizer=.*run\)", data_dir=gpt_data)
    refused(r"m/config\.json: file not found; expected a tfbig run directory",
            init_checkpoint=str(tmp_path / "m"))
    scratch = tmp_path / "scratch"  # a run started without --init_checkpoint
    tf.train.Checkpoint(step=tf.Variable(1)).save(str(scratch / "ckpt"))
    refused(r"scratch holds a checkpoint of a run started from scratch", model_dir=str(scratch))


@pytest.mark.slow  # ~10 s idle for each; GPT-2's case above covers the default run
@pytest.mark.parametrize("family", ["albert", "bert"])
def test_masked_lm_continues_from_a_converted_run(family, albert_data, bert_data, tmp_path):
    """A BERT/ALBERT run directory as tfbig-convert writes it (random weights, heads included,
    the data's vocabulary, a position table longer than the data's sequences)."""
    from tfbig.models.albert import AlbertConfig, AlbertForPretraining
    from tfbig.models.bert import BertConfig, BertForPretraining

    data_dir = albert_data if family == "albert" else bert_data
    config_class, model_class = {"albert": (AlbertConfig, AlbertForPretraining),
                                 "bert": (BertConfig, BertForPretraining)}[family]
    manifest = load_manifest(data_dir)
    config = config_class.from_preset("tiny", vocab_size=manifest.vocab_size, seq_length=40,
                                      dropout=0.0)
    model = model_class(config)
    model.build()
    rng = np.random.default_rng(1)
    weights = {k: (rng.normal(0.0, 0.2, v.shape) + k.endswith("gamma")).astype("float32")
               for k, v in model_variables(model).items()}
    converted = str(tmp_path / "converted")
    run_dir.write(converted, config, weights, manifest.tokenizer_path, False, "test:random",
                  family)
    cfg = _cfg(model=family, init_checkpoint=converted, data_dir=data_dir, seq_length=32,
               model_dir=str(tmp_path / "continued"))
    run_dir.assign(model, weights)
    loss, expected = _first_step_loss_and_reference(Trainer(cfg), model)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    # a backbone-only source (keras-hub, Hugging Face *Model): the heads start fresh
    backbone = str(tmp_path / "backbone")
    run_dir.write(backbone, config, {k: v for k, v in weights.items()
                                     if k.startswith("backbone/")},
                  manifest.tokenizer_path, False, "test:random", family)
    fresh = model_class(config)
    fresh.build()
    missing = init_checkpoint.load(fresh, backbone)
    assert missing and all(k.startswith(("mlm_head/", "nsp_head/", "sop_head/"))
                           for k in missing)
    with open(os.path.join(backbone, "config.json")) as file:
        assert json.load(file)["model_format"] == family


def test_a_rank_loads_its_pieces_after_every_name_and_shape_is_checked(gpt2_bpe, monkeypatch):
    """init_checkpoint.load with a backend's pieces (Strategy.weight_pieces): a shape that
    disagrees with the checkpoint's index is refused before any weight is read; a piece gets
    its cut of the weight; another rank's weight (holder None) is neither read nor assigned;
    no weight is read twice."""
    run = gpt2_bpe["run"]
    reads, weight_reader = [], run_dir.weight_reader

    def counted(directory, mapped=False):
        shapes, read = weight_reader(directory, mapped)
        return shapes, lambda key: reads.append(key) or read(key)

    saved = run_dir.read_weights(run)
    model, _ = load_model(run)
    monkeypatch.setattr(run_dir, "weight_reader", counted)
    variables = model_variables(model)
    for v in variables.values():
        v.assign(tf.zeros_like(v))
    table = next(k for k in saved if saved[k].ndim == 2 and saved[k].shape[0] % 2 == 0)
    other = next(k for k in saved if k != table and np.any(saved[k]))
    pieces = {k: [v, None, tuple(v.shape)] for k, v in variables.items()}
    wrong = {**pieces, table: [variables[table], None, (3, 3)]}
    with pytest.raises(UsageError, match=rf"{table} has shape \({saved[table].shape[0]}, "
                                         rf"{saved[table].shape[1]}\), the model's is \(3, 3\)"):
        init_checkpoint.load(model, run, wrong)
    assert all(not np.any(v.numpy()) for v in variables.values()) and not reads
    half = tf.Variable(tf.zeros((saved[table].shape[0] // 2, saved[table].shape[1])))
    pieces[table] = [half, lambda full: full[full.shape[0] // 2:], saved[table].shape]
    pieces[other] = [None, None, None]
    init_checkpoint.load(model, run, pieces)
    assert sorted(reads) == sorted(set(saved) - {other})
    np.testing.assert_array_equal(half.numpy(), saved[table][saved[table].shape[0] // 2:])
    assert not np.any(variables[table].numpy()) and not np.any(variables[other].numpy())
    assert all(np.array_equal(v.numpy(), saved[k]) for k, v in variables.items()
               if k not in (table, other))


def _saved(directory, **values):
    """A checkpoint of tf.Variables `values` under model/ (a run directory's key layout)."""
    tf.train.Checkpoint(model=tf.train.Checkpoint(**{
        k: tf.Variable(v) for k, v in values.items()})).save(os.path.join(directory, "ckpt"))
    return tf.train.latest_checkpoint(directory)


def test_every_tensor_maps_to_the_bytes_tensorflow_reads(gpt2_bpe, tmp_path):
    """tfbig.checkpoints.bundle reads a checkpoint's index itself: each tensor stored whole,
    memory-mapped where it lies in its data file, equals TensorFlow's reader's value (a
    converted GPT-2 run; float32, float16, bfloat16, int64, a scalar, an empty tensor; 3000
    variables, an index of several blocks); a string is left to TensorFlow's reader; a data
    file cut short is refused naming it."""
    from tfbig.checkpoints import bundle

    rng = np.random.default_rng(0)
    many = {f"layer_{i:04d}_{'of_a_long_name_' * 8}": rng.normal(size=(i % 5 + 1, 3)).astype(
        np.float32) for i in range(3000)}
    made = _saved(tmp_path / "made", half=rng.normal(size=(7, 5)).astype(np.float16),
                  brain=tf.cast(rng.normal(size=(6,)), tf.bfloat16), steps=np.int64(5),
                  scalar=np.float32(2.5), empty=np.zeros((0, 4), np.float32), name="text",
                  **many)
    assert os.path.getsize(made + ".index") > 2 * 262_144  # TensorFlow's table block size
    for prefix in (tf.train.latest_checkpoint(gpt2_bpe["run"]), made):
        places, reader = bundle.tensors(prefix), tf.train.load_checkpoint(prefix)
        stored = reader.get_variable_to_dtype_map()
        assert set(stored) - set(places) == {
            k for k, dtype in stored.items() if dtype == tf.string}
        assert len(places) > 10
        for key, place in places.items():
            value = bundle.mapped(place)
            assert value.dtype == reader.get_tensor(key).dtype, key
            np.testing.assert_array_equal(value, reader.get_tensor(key), err_msg=key)
    assert "model/name/.ATTRIBUTES/VARIABLE_VALUE" not in bundle.tensors(made)
    short = _saved(tmp_path / "short", w=np.ones((100, 100), np.float32))
    (data,) = [p for p in (tmp_path / "short").iterdir() if ".data-" in p.name]
    with open(data, "r+b") as file:  # cut short: refused by name, not a fault when mapped
        file.truncate(os.path.getsize(data) // 2)
    with pytest.raises(UsageError, match=rf"{data}: model/w/.* ends at byte \d+, the file has "
                                         rf"{os.path.getsize(data)}: the checkpoint is "
                                         "truncated"):
        bundle.tensors(short)


@pytest.mark.parametrize("kind", ["column", "flat", "rows"])
def test_a_rank_holds_only_its_piece_of_a_weight_it_reads(kind, tmp_path):
    """init_checkpoint.load hands each cut the memory-mapped weight: a tensor rank's quarter of
    the columns, a ZeRO-3 rank's flat quarter and an expert rank's quarter of the rows are read
    from the mapping, and the process never allocates the whole weight (8 MB here): traced
    allocations peak at the piece and TensorFlow's copy of it (plus 1 MB)."""
    import tracemalloc
    import types

    from tfbig.distribute.zero3 import Partition
    from tfbig.layouts.tensor_layout import take_slice

    full = np.random.default_rng(1).normal(size=(1024, 2048)).astype(np.float32)
    _saved(tmp_path, w=full)
    cut, expected = {
        "column": (lambda w: take_slice(w, -1, 1, 1, 4), full[:, 512:1024]),
        "flat": (lambda w: Partition(None, 4, 2).own(w, w.shape),
                 full.reshape(-1)[2 * full.size // 4:3 * full.size // 4]),
        "rows": (lambda w: take_slice(w, 0, 1, 3, 4), full[768:])}[kind]
    handed = []
    holder = tf.Variable(tf.zeros(expected.shape))
    pieces = {"w": [holder, lambda w: handed.append(type(w)) or cut(w), full.shape]}
    tracemalloc.start()
    try:
        init_checkpoint.load(types.SimpleNamespace(name="m"), str(tmp_path), pieces)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert handed == [np.memmap]
    np.testing.assert_array_equal(holder.numpy(), expected)
    assert peak < 2 * expected.nbytes + 2**20 < full.nbytes, (peak, expected.nbytes)
