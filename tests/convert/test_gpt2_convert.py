"""GPT-2 in and out of the formats users download: a random keras-hub GPT-2 saved with keras-hub's
own preset writer, the same weights written under Hugging Face GPT-2 names with `safetensors`
(checked by loading them with keras-hub's Hugging Face converter), converted by tfbig-convert and
compared with keras-hub's GPT2Backbone / GPT2CausalLM (fp32, 1e-5); the byte-level BPE ids with
keras-hub's GPT2Tokenizer.

keras-hub 0.32's GPT2Tokenizer has two paths: its TensorFlow one (inside tf.function / tf.data,
or `_allow_python_workflow=False`) splits text with GPT-2's own regex; its eager Python one splits
with Llama 3's pattern (punctuation glued to words, digits in threes, "x  y" -> "x", "  ", "y"),
which is not what GPT-2 was trained with. The ids are compared with the TensorFlow path.

Odd sizes (hidden 36, 3 heads of 12, 2 layers, n_positions 40, a ~300-token BPE vocabulary
trained here) exercise the head splits of the fused c_attn.
"""
import dataclasses
import json
import os
import re
import shutil

import keras
import keras_hub
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tfbig.commands.convert import ConvertOptions, convert
from tfbig.convert import run_dir
from tfbig.data.bpe import ByteLevelBPE
from tfbig.data.tokenizer import Tokenizer, for_run
from tfbig.errors import UsageError
from tfbig.models.generation import Generator
from tfbig.convert.run_dir import load_model

HIDDEN, LAYERS, HEADS, POSITIONS = 36, 2, 3, 40
TEXT = ("Héllo, wörld!! Ça va? «Quoi»—naïve café...  東京は晴れ。\n\n"
        "Привет, мир! 42.5% (a+b)=c;\te-mail: x@y.z #tag $5 ~ `q` ÜNÏCÖDÉ "
        "it's they'll we've I'm   spaces  ¿Qué? 😀 naïve's IT'S 1234567 x    y")


def _train_bpe(directory):
    """A ~300-token GPT-2-style vocabulary trained on multilingual text (vocab.json + merges.txt,
    "#version" header and all, as Hugging Face writes them)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [TEXT, "the quick brown fox jumps over the lazy dog",
              "naïve café crème brûlée", "Привет мир привет", "東京 京都 晴れ 雨"] * 5
    backend.train_from_iterator(corpus, trainer)
    os.makedirs(directory, exist_ok=True)
    backend.model.save(directory)
    return os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random keras-hub GPT-2, its tokenizer and its outputs."""
    keras.utils.set_random_seed(4)
    root = tmp_path_factory.mktemp("gpt2")
    vocab, merges = _train_bpe(str(root / "bpe"))
    with open(vocab, encoding="utf-8") as file:
        vocab_size = len(json.load(file))
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab_size, num_layers=LAYERS, num_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=4 * HIDDEN, max_sequence_length=POSITIONS)
    for weight in backbone.weights:  # LayerNorms away from 1/0, so a swap would show
        weight.assign(np.random.default_rng(len(weight.path)).normal(
            0.0, 0.3 if "norm" not in weight.path else 1.0, weight.shape).astype("float32"))
    causal_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    token_ids = np.random.default_rng(0).integers(0, vocab_size, (2, 13)).astype("int32")
    inputs = {"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)}
    return {"root": root, "backbone": backbone, "causal_lm": causal_lm, "vocab": vocab,
            "merges": merges, "vocab_size": vocab_size, "inputs": inputs,
            "hidden": np.asarray(backbone(inputs)), "logits": np.asarray(causal_lm(inputs))}


def _convert(source, output_dir, **kwargs):
    return convert(ConvertOptions(source=str(source), output_dir=str(output_dir), **kwargs))


def _assert_equal_outputs(run, reference):
    """Final hidden states (after ln_f) and logits of the converted run equal keras-hub's."""
    model, _ = load_model(str(run))  # what tfbig-generate loads
    x = model.embedding(reference["inputs"]["token_ids"])
    for block in model.blocks:
        x = block(x)
    np.testing.assert_allclose(np.asarray(model.final_norm(x)), reference["hidden"],
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model(reference["inputs"]["token_ids"])),
                               reference["logits"], atol=1e-5, rtol=1e-5)
    return model


def _write_hf(reference, directory):
    """Hugging Face GPT2Model names from keras-hub weights (written here, not by tfbig)."""
    w = {x.path: np.asarray(x.numpy()) for x in reference["backbone"].weights}
    h = HIDDEN
    t = {"wte.weight": w["token_embedding/embeddings"],
         "wpe.weight": w["position_embedding/embeddings"],
         "ln_f.weight": w["layer_norm/gamma"], "ln_f.bias": w["layer_norm/beta"]}
    for i in range(LAYERS):
        k, p = f"transformer_layer_{i}/", f"h.{i}."
        a = k + "self_attention/"
        t[p + "attn.c_attn.weight"] = np.concatenate(
            [w[f"{a}{n}/kernel"].reshape(h, h) for n in ("query", "key", "value")], axis=1)
        t[p + "attn.c_attn.bias"] = np.concatenate(
            [w[f"{a}{n}/bias"].reshape(h) for n in ("query", "key", "value")])
        t[p + "attn.c_proj.weight"] = w[a + "attention_output/kernel"].reshape(h, h)
        t[p + "attn.c_proj.bias"] = w[a + "attention_output/bias"]
        t[p + "ln_1.weight"] = w[k + "self_attention_layer_norm/gamma"]
        t[p + "ln_1.bias"] = w[k + "self_attention_layer_norm/beta"]
        t[p + "ln_2.weight"] = w[k + "feedforward_layer_norm/gamma"]
        t[p + "ln_2.bias"] = w[k + "feedforward_layer_norm/beta"]
        t[p + "mlp.c_fc.weight"] = w[k + "feedforward_intermediate_dense/kernel"]
        t[p + "mlp.c_fc.bias"] = w[k + "feedforward_intermediate_dense/bias"]
        t[p + "mlp.c_proj.weight"] = w[k + "feedforward_output_dense/kernel"]
        t[p + "mlp.c_proj.bias"] = w[k + "feedforward_output_dense/bias"]
        t[p + "attn.bias"] = np.tril(np.ones((1, 1, POSITIONS, POSITIONS), "float32"))  # buffer
    os.makedirs(directory)
    save_file({n: np.ascontiguousarray(v) for n, v in t.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
              "vocab_size": reference["vocab_size"], "n_positions": POSITIONS, "n_ctx": POSITIONS,
              "n_embd": h, "n_layer": LAYERS, "n_head": HEADS, "n_inner": None,
              "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
              "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
              "scale_attn_weights": True, "bos_token_id": 0, "eos_token_id": 0}
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file)
    shutil.copyfile(reference["vocab"], os.path.join(directory, "vocab.json"))
    shutil.copyfile(reference["merges"], os.path.join(directory, "merges.txt"))
    return directory


def test_keras_hub_preset_and_generation(reference):
    root = reference["root"]
    preset = str(root / "preset")
    reference["backbone"].save_to_preset(preset)
    keras_hub.models.GPT2Tokenizer(vocabulary=reference["vocab"],
                                   merges=reference["merges"]).save_to_preset(preset)
    _convert(preset, root / "from_keras_hub")
    model = _assert_equal_outputs(root / "from_keras_hub", reference)
    with open(root / "from_keras_hub" / "config.json") as file:
        assert json.load(file)["tokenizer"]["kind"] == "byte_level_bpe"
    # greedy decoding: tfbig's cached generator and keras-hub's GPT2CausalLM.generate agree
    tokenizer = for_run(str(root / "from_keras_hub"))  # what tfbig-generate tokenizes with
    assert isinstance(tokenizer, ByteLevelBPE)
    prompt = tokenizer.encode("Привет, naïve café")
    steps = 6
    ours = Generator(model)([prompt], steps, temperature=0.0)[0]
    causal_lm = reference["causal_lm"]
    causal_lm.compile(sampler="greedy")
    length = len(prompt) + steps
    padded = np.zeros((1, length), "int32")
    padded[0, :len(prompt)] = prompt
    mask = np.arange(length)[None] < len(prompt)  # keras-hub fills the masked-out positions
    theirs = causal_lm.generate({"token_ids": padded, "padding_mask": mask},
                                stop_token_ids=None)["token_ids"][0]
    assert [int(t) for t in ours] == [int(t) for t in theirs]
    assert len(set(int(t) for t in ours[len(prompt):])) > 1  # not one token repeated


def test_huggingface_directory_and_export_round_trip(reference):
    root = reference["root"]
    hf = _write_hf(reference, str(root / "hf"))
    # the file is what keras-hub's own Hugging Face converter reads as this model
    loaded = keras_hub.models.GPT2Backbone.from_preset(hf)
    np.testing.assert_allclose(loaded(reference["inputs"]), reference["hidden"], atol=1e-6)
    _convert(hf, root / "from_hf")
    _assert_equal_outputs(root / "from_hf", reference)
    # export -> keras-hub reads it with equal logits; re-import is bit-exact
    _convert(root / "from_hf", root / "exported", to="huggingface")
    assert sorted(os.listdir(root / "exported")) == [
        "config.json", "merges.txt", "model.safetensors", "vocab.json"]
    assert "transformer.h.1.attn.c_attn.weight" in load_file(root / "exported" /
                                                             "model.safetensors")
    exported = keras_hub.models.GPT2CausalLM(
        backbone=keras_hub.models.GPT2Backbone.from_preset(str(root / "exported")),
        preprocessor=None)
    np.testing.assert_allclose(np.asarray(exported(reference["inputs"])), reference["logits"],
                               atol=1e-5, rtol=1e-5)
    tokenizer = keras_hub.models.GPT2Tokenizer.from_preset(str(root / "exported"),
                                                           _allow_python_workflow=False)
    assert [int(i) for i in tokenizer(TEXT)] == ByteLevelBPE.load(
        reference["vocab"], reference["merges"]).encode(TEXT)
    _convert(root / "exported", root / "reimported")
    first, second = run_dir.read_weights(root / "from_hf"), run_dir.read_weights(
        root / "reimported")
    assert sorted(first) == sorted(second)
    assert all(np.array_equal(first[k], second[k]) for k in first)


def _tf_gpt2_weight(pt_name, value):
    """transformers' TF GPT-2 spelling (modeling_tf_gpt2.py) of a PyTorch GPT2Model tensor:
    (TF name below the model, stored value). One layer, transformer; h.i is h_._i; wte is a
    TFSharedEmbeddings (`weight`), wpe a table (`embeddings`); LayerNorms gamma/beta; Conv1D
    weights (in, out) as in PyTorch, their biases stored (1, out)."""
    scope, leaf = pt_name.rsplit(".", 1)
    scope = re.sub(r"^h/(\d+)", r"h_._\1", scope.replace(".", "/"))
    if scope.rsplit("/", 1)[-1] in ("ln_1", "ln_2", "ln_f"):
        leaf = {"weight": "gamma", "bias": "beta"}[leaf]
    elif scope == "wpe":
        leaf = "embeddings"
    elif leaf == "bias":
        value = value[None]
    return f"transformer/{scope}/{leaf}", value


@pytest.mark.parametrize("weights_file", ["tf_model.h5", "model.safetensors"])
def test_huggingface_tf_weights(reference, write_tf_model_h5, write_tf_safetensors, tmp_path,
                                weights_file):
    """transformers' TF weights (TFGPT2LMHeadModel: one layer, transformer), as tf_model.h5 or
    as the TF-named model.safetensors of save_pretrained(safe_serialization=True), instead of a
    PyTorch model.safetensors: keras-hub's hidden states and logits."""
    hf = _write_hf(reference, str(tmp_path / "hf"))
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    os.remove(os.path.join(hf, "model.safetensors"))
    stored = dict(_tf_gpt2_weight(n, v) for n, v in tensors.items()
                  if not n.endswith(".attn.bias"))  # a PyTorch buffer, not a weight
    h5 = weights_file == "tf_model.h5"
    write = write_tf_model_h5 if h5 else write_tf_safetensors
    written = write(os.path.join(hf, weights_file), "tfgp_t2lm_head_model",
                    {"transformer": stored})
    scope = "tfgp_t2lm_head_model/" if h5 else ""  # the TF safetensors drop the model's name
    assert {f"{scope}transformer/h_._1/attn/c_attn/weight:0",
            f"{scope}transformer/wte/weight:0"} <= set(written)
    assert stored["transformer/h_._0/attn/c_attn/bias"].shape == (1, 3 * HIDDEN)
    _convert(hf, tmp_path / "run")
    _assert_equal_outputs(tmp_path / "run", reference)


def test_untied_head_and_config_fields_round_trip(reference, tmp_path):
    """Fields keras-hub cannot express (n_inner, layer_norm_epsilon, an untied lm_head) still
    reach tfbig's GPTConfig and come back out unchanged."""
    hf = _write_hf(reference, str(tmp_path / "hf"))
    rng = np.random.default_rng(1)
    tensors = dict(load_file(os.path.join(hf, "model.safetensors")))
    inner = 50
    for i in range(LAYERS):
        tensors[f"h.{i}.mlp.c_fc.weight"] = rng.normal(size=(HIDDEN, inner)).astype("float32")
        tensors[f"h.{i}.mlp.c_fc.bias"] = rng.normal(size=(inner,)).astype("float32")
        tensors[f"h.{i}.mlp.c_proj.weight"] = rng.normal(size=(inner, HIDDEN)).astype("float32")
    tensors["lm_head.weight"] = rng.normal(size=(reference["vocab_size"], HIDDEN)).astype(
        "float32")
    save_file(tensors, os.path.join(hf, "model.safetensors"))
    _edit_json(os.path.join(hf, "config.json"), n_inner=inner, layer_norm_epsilon=1e-6,
               tie_word_embeddings=False)
    _convert(hf, tmp_path / "run")
    config, _ = run_dir.read_config(tmp_path / "run", families=("gpt",))
    assert (config.intermediate_size, config.layer_norm_epsilon, config.tie_embeddings) == \
        (inner, 1e-6, False)
    weights = run_dir.read_weights(tmp_path / "run")
    np.testing.assert_array_equal(weights["head/kernel"], tensors["lm_head.weight"].T)
    _convert(tmp_path / "run", tmp_path / "out", to="huggingface")
    back = load_file(tmp_path / "out" / "model.safetensors")
    np.testing.assert_array_equal(back["lm_head.weight"], tensors["lm_head.weight"])
    np.testing.assert_array_equal(back["transformer.h.1.mlp.c_proj.weight"],
                                  tensors["h.1.mlp.c_proj.weight"])
    with open(tmp_path / "out" / "config.json") as file:
        saved = json.load(file)
    assert (saved["n_inner"], saved["layer_norm_epsilon"], saved["tie_word_embeddings"]) == \
        (inner, 1e-6, False)


def test_export_of_a_sentencepiece_run_says_the_tokenizer_is_not_gpt2s(reference, tmp_path,
                                                                      capsys):
    """A tfbig-trained GPT carries tfbig's SentencePiece model: the export writes the weights,
    copies tokenizer.model and no vocab.json/merges.txt, and says so."""
    weights = run_dir.read_weights(_hf_run(reference))
    config, _ = run_dir.read_config(_hf_run(reference), families=("gpt",))
    sentencepiece = Tokenizer.train(["the quick brown fox jumps over the lazy dog\n" * 50],
                                    vocab_size=290,
                                    model_prefix=str(tmp_path / "sp"))
    run = str(tmp_path / "sp_run")
    run_dir.write_run(run, config, weights, {"vocab_file": "tokenizer.model"},
                      {"tokenizer.model": sentencepiece.path}, "tfbig-train", "gpt")
    _convert(run, tmp_path / "out", to="huggingface")
    assert "tokenizer: NOT GPT-2's" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json", "model.safetensors", "tokenizer.model"]
    with open(tmp_path / "out" / "config.json") as file:
        assert json.load(file)["eos_token_id"] == sentencepiece.eos_id
    # a post-LN tfbig GPT has no GPT-2 equivalent
    post_ln = str(tmp_path / "post_ln")
    run_dir.write_run(post_ln, dataclasses.replace(config, pre_layer_norm=False),
                      {k: v for k, v in weights.items() if not k.startswith("final_norm")},
                      {"vocab_file": "tokenizer.model"}, {"tokenizer.model": sentencepiece.path},
                      "tfbig-train", "gpt")
    with pytest.raises(UsageError, match=r"post_ln: pre_layer_norm=False \(post-LN\); a "
                                         r"Hugging Face GPT-2 is pre-LN"):
        _convert(post_ln, tmp_path / "post_ln_out", to="huggingface")


@pytest.mark.slow
def test_savedmodel_export_of_a_converted_gpt2_carries_its_bpe(reference, tmp_path):
    """tfbig-export (SavedModel for serving) of a converted GPT-2: the BPE files are its assets
    and the serving signature gives keras-hub's logits."""
    import tensorflow as tf

    from tfbig.commands.export import export

    exported = export(str(_hf_run(reference)), str(tmp_path / "savedmodel"))
    assert sorted(os.listdir(os.path.join(exported, "assets"))) == ["merges.txt", "vocab.json"]
    logits = tf.saved_model.load(exported).signatures["serving_default"](
        token_ids=tf.constant(reference["inputs"]["token_ids"]))["logits"]
    np.testing.assert_allclose(logits.numpy(), reference["logits"], atol=1e-5, rtol=1e-5)


def test_tfbig_train_refuses_a_converted_run_and_leaves_it_intact(reference, gpt_data,
                                                                  tmp_path):
    """Pointed at a converted run as --model_dir, tfbig-train would overwrite the run's
    config.json (and so its tokenizer entry); it refuses, naming --init_checkpoint instead."""
    from tfbig.config import ExperimentConfig
    from tfbig.training.trainer import Trainer

    run = tmp_path / "run"
    shutil.copytree(_hf_run(reference), run)
    before = (run / "config.json").read_text()
    cfg = ExperimentConfig()
    for key, value in dict(data_dir=gpt_data, model_dir=str(run), preset="tiny", seq_length=16,
                           batch_size=8, max_steps=1, xla=False, sample_tokens=0).items():
        setattr(cfg.train, key, value)
    with pytest.raises(ValueError, match=r"run is a tfbig-convert run directory \(huggingface:"
                                         r".*Continue training it with --init_checkpoint="):
        Trainer(cfg)
    assert (run / "config.json").read_text() == before


def _hf_run(reference):
    run = reference["root"] / "from_hf"
    if not run.exists():
        _convert(_write_hf(reference, str(reference["root"] / "hf_for_run")), run)
    return run


def test_byte_level_bpe_ids_equal_keras_hub(reference):
    ours = ByteLevelBPE.load(reference["vocab"], reference["merges"])
    theirs = keras_hub.models.GPT2Tokenizer(vocabulary=reference["vocab"],
                                            merges=reference["merges"],
                                            _allow_python_workflow=False)
    for text in (TEXT, TEXT.upper(), " " + TEXT + "\n", "end.<|endoftext|>Next"):
        ids = ours.encode(text)
        assert ids == [int(i) for i in theirs(text)]
        assert ours.decode(ids) == text.replace("<|endoftext|>", "")
    ids = ours.encode(TEXT)
    assert len(set(ids)) > 40 and len(ids) < len(TEXT.encode())  # real merges
    assert ours.encode("<|endoftext|>") == [ours.eos_id] == [0]  # trained first
    assert ours.piece_byte_lengths()[ids].sum() == len(TEXT.encode())


def _edit_json(path, **changes):
    with open(path) as file:
        content = json.load(file)
    with open(path, "w") as file:
        json.dump({**content, **changes}, file)


def test_bad_inputs_name_the_file(reference, tmp_path):
    hf = _write_hf(reference, str(tmp_path / "hf"))

    def fails(source, match, **kwargs):
        with pytest.raises(UsageError, match=match):
            _convert(source, tmp_path / "out", **kwargs)

    def copy(name, **config):
        shutil.copytree(hf, tmp_path / name)
        if config:
            _edit_json(tmp_path / name / "config.json", **config)
        return tmp_path / name

    fails(copy("gemma", model_type="gemma"),
          r"gemma/config\.json: model_type='gemma'; tfbig-convert reads BERT, ALBERT and GPT-2")
    # a GPT-2 config called a Llama goes to the Llama reader, which names what it lacks
    fails(copy("llama", model_type="llama"),
          r"llama/config\.json: missing \['hidden_size', .*expected a LlamaForCausalLM config")
    fails(copy("bert", model_type="bert"), r"bert/config\.json: missing \['hidden_size', ")
    no_merges = copy("no_merges")
    os.remove(no_merges / "merges.txt")
    fails(no_merges, r"no_merges/merges\.txt: file not found \(the BPE merges")
    bad_merges = copy("bad_merges")
    with open(bad_merges / "merges.txt", "a", encoding="utf-8") as file:
        file.write("notatoken alsonot\n")
    fails(bad_merges, r"bad_merges/merges\.txt: cannot read it as the merges of .*vocab\.json")
    fails(copy("inner", n_inner=64), r"inner/model\.safetensors: h\.0\.mlp\.c_fc\.weight has "
                                     r"shape \(36, 144\) but the config .*n_inner=64\) implies "
                                     r"\(36, 64\)")
    fails(copy("positions", n_positions=64),
          r"positions/model\.safetensors: wpe\.weight has shape \(40, 36\) but the config")
    fails(copy("layers", n_layer=3), r"layers/model\.safetensors: no h\.2\.ln_1\.weight")
    fails(copy("untied", tie_word_embeddings=False),
          r"untied/model\.safetensors: no lm_head\.weight")
    fails(copy("heads", n_head=5), r"heads/config\.json: hidden_size=36 is not divisible by "
                                   r"num_heads=5")
    fails(copy("relu", activation_function="relu"),
          r"relu/config\.json: activation_function='relu'; tfbig's GPT computes the tanh GELU")
    fails(copy("scaled", scale_attn_by_inverse_layer_idx=True),
          r"scaled/config\.json: scale_attn_by_inverse_layer_idx=True")
    fails(copy("drops", attn_pdrop=0.0), r"drops/config\.json: .*'attn_pdrop': 0\.0.* one "
                                         r"dropout rate")
    vocab = copy("vocab")
    with open(vocab / "vocab.json", encoding="utf-8") as file:
        entries = json.load(file)
    entries["surplus"] = len(entries)
    with open(vocab / "vocab.json", "w", encoding="utf-8") as file:
        json.dump(entries, file)
    fails(vocab, rf"vocab/vocab\.json: {len(entries)} tokens, but .*config\.json says "
                 rf"vocab_size={len(entries) - 1}")
    torch_only = copy("torch_only")
    os.rename(torch_only / "model.safetensors", torch_only / "pytorch_model.bin")
    fails(torch_only, r"model\.safetensors: file not found \(found \['pytorch_model\.bin'\]")
    tf_only = copy("tf_only")
    os.rename(tf_only / "model.safetensors", tf_only / "tf_model.h5")
    fails(tf_only, r"tf_only/tf_model\.h5: not an HDF5 file")
    fails(hf, r"--lowercase=true: applies to BERT's WordPiece vocabulary; .* is a GPT-2",
          lowercase="true")
    with pytest.raises(UsageError, match=r"config\.json: model_format='gpt'; expected one of "
                                         r"\['bert'\]"):
        run_dir.read_config(_hf_run(reference))
