"""--model=llama through the trainer on one process: the loss falls on the tiny corpus, the run
directory says model_format "llama", tfbig-generate loads it and continues a prompt through its
SentencePiece tokenizer (greedy: full recomputation's argmax), and its Hugging Face export is
read by keras-hub with the trained model's logits. (Two Horovod ranks against one process:
tests/distribute/test_horovod_llama.py.)"""
import json
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import make_cfg  # noqa: E402

from tfbig.models.generation import Generator  # noqa: E402
from tfbig.convert.run_dir import load_model
from tfbig.models.llama import Llama  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


def llama_cfg(data, model_dir, **train):
    return make_cfg(data, model_dir, model="llama", **train)


def test_llama_trains_generates_and_exports(gpt_data, tmp_path):
    trainer = Trainer(llama_cfg(gpt_data, tmp_path / "run", max_steps=15, log_every=15,
                                learning_rate=1e-2))
    assert isinstance(trainer.model, Llama)
    assert trainer.model.config.num_kv_heads == 2 and trainer.model.config.num_heads == 4
    first = trainer.evaluate()["loss"]
    summary = trainer.fit()
    assert summary["eval"]["loss"] < first - 0.5, (first, summary["eval"])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model_format"] == "llama" and saved["model_config"]["num_kv_heads"] == 2

    model, _ = load_model(str(tmp_path / "run"))
    tokens = np.array([[5, 9, 2, 7, 11, 3]], np.int32)
    np.testing.assert_allclose(model(tokens).numpy(), trainer.model(tokens).numpy(), atol=1e-6)
    out = Generator(model)(tokens[:, :3], 4, temperature=0.0)
    assert out.shape == (1, 7)
    # tfbig-generate's text path with the run's SentencePiece tokenizer: greedy continuation of
    # a prompt (KV cache) equals the argmax of full recomputation, token for token
    from tfbig.data.tokenizer import Tokenizer, for_run
    from tfbig.models.generation import sample_text

    tokenizer = for_run(str(tmp_path / "run"))
    assert isinstance(tokenizer, Tokenizer)
    ids = tokenizer.encode("ROMEO: the")
    for _ in range(6):
        ids.append(int(np.argmax(model(np.array([ids], np.int32)).numpy()[0, -1])))
    expected = tokenizer.decode([i for i in ids if i != tokenizer.eos_id])
    assert sample_text(model, tokenizer, "ROMEO: the", 6, temperature=0.0) == expected

    keras_hub = pytest.importorskip("keras_hub")
    from tfbig.commands.convert import ConvertOptions, convert

    convert(ConvertOptions(source=str(tmp_path / "run"), output_dir=str(tmp_path / "hf"),
                           to="huggingface"))
    assert os.path.isfile(tmp_path / "hf" / "tokenizer.model")  # tfbig's SentencePiece model
    # keras-hub's Llama reader takes no rms_norm_eps (it builds 1e-6); tfbig's default is 1e-5
    backbone = keras_hub.models.LlamaBackbone.from_preset(str(tmp_path / "hf"), dtype="float32",
                                                          layer_norm_epsilon=1e-5)
    hidden = backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
    theirs = np.asarray(backbone.token_embedding(hidden, reverse=True))
    np.testing.assert_allclose(theirs, model(tokens).numpy(), atol=1e-5, rtol=0)


def test_training_starts_from_a_converted_keras_hub_llama(gpt_data, tmp_path):
    """tfbig-convert of a keras-hub preset, then --init_checkpoint: the trainer's model starts
    with keras-hub's logits (its vocabulary is the data's, 320); the test above trains."""
    keras_hub = pytest.importorskip("keras_hub")
    import keras

    from tfbig.commands.convert import ConvertOptions, convert

    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=320, num_layers=2, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=32, intermediate_dim=72, dtype="float32")
    rng = np.random.default_rng(0)
    for w in backbone.weights:
        if w.path.endswith("scale"):
            w.assign(1 + 0.3 * rng.standard_normal(w.shape).astype("float32"))
    backbone.save_to_preset(str(tmp_path / "preset"))
    convert(ConvertOptions(source=str(tmp_path / "preset"), output_dir=str(tmp_path / "run")))

    cfg = llama_cfg(gpt_data, tmp_path / "train", init_checkpoint=str(tmp_path / "run"),
                    preset="small", num_layers=0, hidden_size=0, num_heads=0, max_steps=2)
    trainer = Trainer(cfg)
    assert trainer.model.config.num_kv_heads == 1  # the checkpoint's architecture (MQA)
    tokens = np.array([[5, 9, 2, 7, 11, 300]], np.int32)
    hidden = backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
    theirs = np.asarray(backbone.token_embedding(hidden, reverse=True))
    np.testing.assert_allclose(trainer.model(tokens).numpy(), theirs, atol=1e-5, rtol=0)


def test_training_starts_from_a_hugging_face_directory_read_in_place(gpt_data, tmp_path):
    """--init_checkpoint=a Hugging Face directory (sharded safetensors with its index): the
    weights are read from the safetensors files themselves, memory-mapped (a kernel as the
    transposed view), and equal the run it was exported from; the first step's loss is the
    one of a run started from that run directory. So does a mixture-of-experts directory,
    whose experts (one tensor each there, one stacked weight per matrix in tfbig) are read one
    expert at a time: an expert rank's cut reads its own experts' tensors and no other's."""
    from tfbig.checkpoints.checkpoint import model_variables
    from tfbig.convert import llama
    from tfbig.errors import UsageError

    source = tmp_path / "source"
    Trainer(llama_cfg(gpt_data, source, max_steps=1, seed=5)).fit()
    llama.export(str(source), str(tmp_path / "hf"), max_shard_bytes=20_000)
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    assert len([n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]) > 2
    _, _, read = llama.huggingface_weight_reader(str(tmp_path / "hf"))
    kernel = read("block_0/mlp/gate/kernel")
    assert isinstance(kernel.base, np.memmap) and not kernel.flags["C_CONTIGUOUS"]

    starts = {}
    for name, directory in (("hf", tmp_path / "hf"), ("run", source)):
        cfg = llama_cfg(gpt_data, tmp_path / f"from_{name}", init_checkpoint=str(directory),
                        preset="small", num_layers=0, hidden_size=0, num_heads=0, max_steps=1)
        trainer = Trainer(cfg)
        starts[name] = ({k: v.numpy() for k, v in model_variables(trainer.model).items()},
                        trainer.fit()["train"]["loss"])
    saved = load_model(str(source))[0]
    assert sorted(starts["hf"][0]) == sorted(model_variables(saved))
    for key, value in model_variables(saved).items():
        np.testing.assert_array_equal(starts["hf"][0][key], value.numpy(), err_msg=key)
    assert starts["hf"][1] == starts["run"][1]

    moe = tmp_path / "moe"
    Trainer(llama_cfg(gpt_data, moe, max_steps=1, preset="tiny-moe", num_layers=0,
                      hidden_size=0, num_heads=0, seed=5)).fit()
    llama.export(str(moe), str(tmp_path / "moe_hf"))
    cfg = llama_cfg(gpt_data, tmp_path / "from_moe", init_checkpoint=str(tmp_path / "moe_hf"),
                    preset="small", num_layers=0, hidden_size=0, num_heads=0, max_steps=1)
    started = model_variables(Trainer(cfg).model)
    saved = model_variables(load_model(str(moe))[0])
    assert sorted(started) == sorted(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(started[key].numpy(), value.numpy(), err_msg=key)

    from tfbig.layouts.tensor_layout import take_slice

    _, shapes, read = llama.huggingface_weight_reader(str(tmp_path / "moe_hf"))
    stacked = read("block_1/mlp/experts/down")
    assert shapes["block_1/mlp/experts/down"] == stacked.shape == (4, 64, 32)
    whole = saved["block_1/mlp/experts/down"].numpy()
    for j in (0, 1):  # expert rank 1 of 2 holds experts 2 and 3: the others are never read
        stacked.parts[j] = lambda j=j: pytest.fail(f"expert {j} was read")
    np.testing.assert_array_equal(take_slice(stacked, 0, 1, 1, 2), whole[2:])
    # a ZeRO-3 rank's flat range (tfbig.distribute.zero3.Partition.own) over experts 2-3
    np.testing.assert_array_equal(stacked.flat_range(2 * 2048 + 100, 4 * 2048 - 5),
                                  whole.reshape(-1)[2 * 2048 + 100:4 * 2048 - 5])

    from safetensors.numpy import load_file, save_file

    lacking = tmp_path / "moe_hf_lacking"
    shutil.copytree(tmp_path / "moe_hf", lacking)
    tensors = load_file(str(lacking / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(lacking / "model.safetensors"))
    cfg = llama_cfg(gpt_data, tmp_path / "from_lacking", init_checkpoint=str(lacking),
                    preset="small", num_layers=0, hidden_size=0, num_heads=0, max_steps=1)
    with pytest.raises(UsageError, match=r"1 expert tensors missing for num_experts=4, e\.g\. "
                                         r"\['model.layers.1.block_sparse_moe.experts.3.w2"):
        Trainer(cfg)
    assert not os.path.exists(tmp_path / "from_lacking")
