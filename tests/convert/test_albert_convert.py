"""ALBERT in from the formats users download, and out to Hugging Face: a random keras-hub ALBERT with odd sizes (E 10,
hidden 36, 3 heads, intermediate 52, vocabulary 101, 4 layers in 2 groups) written by
keras-hub (`save_to_preset`), under the Hugging Face names with `safetensors` (checked by
keras-hub's own Hugging Face converter) and under the Google TF1 `model.ckpt` names with
TensorFlow's checkpoint writer; converted, tfbig's ALBERT equals keras-hub's (fp32, 1e-5)."""
import json
import os
import re
import shutil

import keras
import keras_hub
import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf
from safetensors.numpy import save_file

from tfbig.commands.convert import ConvertOptions, convert
from tfbig.convert import run_dir
from tfbig.data.albert_spm import AlbertSentencePiece
from tfbig.errors import UsageError
from tfbig.models.albert import AlbertConfig, AlbertForPretraining, AlbertForQuestionAnswering
from tfbig.tasks.squad_model import pretrained_config

SIZES = dict(vocabulary_size=101, num_layers=4, num_groups=2, num_heads=3, embedding_dim=10,
             hidden_dim=36, intermediate_dim=52, max_sequence_length=40, num_segments=2,
             num_inner_repetitions=1)
E, H = 10, 36


def _sentencepiece(directory):
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, 12)) for _ in range(300)]
    prefix = os.path.join(directory, "sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=101, model_type="bpe",
        user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"], pad_id=0, unk_id=1, bos_id=-1,
        eos_id=-1, minloglevel=2)
    return prefix + ".model"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    keras.utils.set_random_seed(4)
    root = tmp_path_factory.mktemp("albert")
    backbone = keras_hub.models.AlbertBackbone(**SIZES)
    for weight in backbone.weights:
        weight.assign(np.random.default_rng(len(weight.path)).normal(
            0.0, 0.3 if "norm" not in weight.path else 1.0, weight.shape).astype("float32"))
    rng = np.random.default_rng(0)
    inputs = {"token_ids": rng.integers(0, 101, (2, 11)).astype("int32"),
              "segment_ids": (np.arange(11)[None] >= 5).astype("int32").repeat(2, 0),
              "padding_mask": (np.arange(11)[None] < np.array([[11], [7]])).astype("int32")}
    outputs = {k: np.asarray(v) for k, v in backbone(inputs).items()}
    weights = {w.path: np.asarray(w.numpy()) for w in backbone.weights}
    return {"root": root, "backbone": backbone, "weights": weights, "inputs": inputs,
            "outputs": outputs, "spm": _sentencepiece(str(root))}


def _assert_equal_outputs(run, reference):
    with open(os.path.join(run, "config.json")) as file:
        saved = json.load(file)
    assert saved["model_format"] == "albert"
    model = AlbertForQuestionAnswering(AlbertConfig(**saved["model_config"]))
    model.build()
    run_dir.restore_backbone(model, run)
    x = reference["inputs"]
    sequence, pooled = model.backbone(x["token_ids"], x["segment_ids"], x["padding_mask"])
    real = x["padding_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(sequence)[real],
                               reference["outputs"]["sequence_output"][real], atol=1e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(pooled, reference["outputs"]["pooled_output"], atol=1e-5,
                               rtol=1e-5)
    assert os.path.isfile(os.path.join(run, "tokenizer.model"))


def _convert(source, output_dir, **kwargs):
    return convert(ConvertOptions(source=str(source), output_dir=str(output_dir), **kwargs))


def _per_layer(w, g):
    """Group g's tensors from keras-hub, flattened to (in, out) kernels."""
    k = f"group_{g}_inner_layer_0/"
    out = {}
    for name in ("query", "key", "value"):
        out[name] = (w[f"{k}self_attention_layer/{name}/kernel"].reshape(H, H),
                     w[f"{k}self_attention_layer/{name}/bias"].reshape(H))
    out["dense"] = (w[k + "self_attention_layer/attention_output/kernel"].reshape(H, H),
                    w[k + "self_attention_layer/attention_output/bias"])
    out["ln"] = (w[k + "self_attention_layer_norm/gamma"], w[k + "self_attention_layer_norm/beta"])
    out["ffn"] = (w[k + "feedforward_intermediate_dense/kernel"],
                  w[k + "feedforward_intermediate_dense/bias"])
    out["ffn_output"] = (w[k + "feedforward_output_dense/kernel"],
                         w[k + "feedforward_output_dense/bias"])
    out["ln_1"] = (w[k + "feedforward_layer_norm/gamma"], w[k + "feedforward_layer_norm/beta"])
    return out


def _config_json(**extra):
    return {"vocab_size": 101, "embedding_size": E, "hidden_size": H, "num_hidden_layers": 4,
            "num_hidden_groups": 2, "inner_group_num": 1, "num_attention_heads": 3,
            "intermediate_size": 52, "max_position_embeddings": 40, "type_vocab_size": 2,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **extra}


def test_keras_hub_preset(reference):
    preset = str(reference["root"] / "preset")
    reference["backbone"].save_to_preset(preset)
    keras_hub.tokenizers.AlbertTokenizer(proto=reference["spm"]).save_to_preset(preset)
    _convert(preset, reference["root"] / "from_keras_hub")
    _assert_equal_outputs(str(reference["root"] / "from_keras_hub"), reference)


def test_export_loads_in_keras_hub_and_reimports_exactly(reference):
    root = reference["root"]
    source = root / "from_keras_hub"
    if not source.exists():
        test_keras_hub_preset(reference)
    _convert(source, root / "albert_hf", to="huggingface")
    exported = keras_hub.models.AlbertBackbone.from_preset(str(root / "albert_hf"))
    x, real = reference["inputs"], reference["inputs"]["padding_mask"].astype(bool)
    out = exported(x)
    np.testing.assert_allclose(np.asarray(out["sequence_output"])[real],
                               reference["outputs"]["sequence_output"][real], atol=1e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(out["pooled_output"], reference["outputs"]["pooled_output"],
                               atol=1e-5, rtol=1e-5)
    _convert(root / "albert_hf", root / "albert_back")
    first, second = run_dir.read_weights(source), run_dir.read_weights(root / "albert_back")
    assert sorted(first) == sorted(second)
    assert all(np.array_equal(first[k], second[k]) for k in first)


def _hf_tensors(w):
    """AlbertModel's Hugging Face tensors of keras-hub weights `w` (written here, not by tfbig)."""
    t = {"albert.embeddings.word_embeddings.weight": w["token_embedding/embeddings"],
         "albert.embeddings.position_embeddings.weight": w["position_embedding/embeddings"],
         "albert.embeddings.token_type_embeddings.weight": w["segment_embedding/embeddings"],
         "albert.embeddings.LayerNorm.weight": w["embeddings_layer_norm/gamma"],
         "albert.embeddings.LayerNorm.bias": w["embeddings_layer_norm/beta"],
         "albert.encoder.embedding_hidden_mapping_in.weight": w["embedding_projection/kernel"].T,
         "albert.encoder.embedding_hidden_mapping_in.bias": w["embedding_projection/bias"],
         "albert.pooler.weight": w["pooled_dense/kernel"].T,
         "albert.pooler.bias": w["pooled_dense/bias"]}
    names = {"query": "attention.query", "key": "attention.key", "value": "attention.value",
             "dense": "attention.dense", "ffn": "ffn", "ffn_output": "ffn_output",
             "ln": "attention.LayerNorm", "ln_1": "full_layer_layer_norm"}
    for g in range(2):
        for part, (a, b) in _per_layer(w, g).items():
            p = f"albert.encoder.albert_layer_groups.{g}.albert_layers.0.{names[part]}."
            t[p + "weight"] = a if part.startswith("ln") else a.T
            t[p + "bias"] = b
    return t


def test_huggingface_directory(reference):
    w, d = reference["weights"], str(reference["root"] / "hf")
    t = _hf_tensors(w)
    os.makedirs(d)
    save_file({n: np.ascontiguousarray(v) for n, v in t.items()},
              os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as file:
        json.dump(_config_json(model_type="albert", hidden_act="gelu_new"), file)
    shutil.copyfile(reference["spm"], os.path.join(d, "spiece.model"))
    loaded = keras_hub.models.AlbertBackbone.from_preset(d)  # keras-hub reads it as this model
    np.testing.assert_allclose(loaded(reference["inputs"])["pooled_output"],
                               reference["outputs"]["pooled_output"], atol=1e-6)
    _convert(d, reference["root"] / "from_hf")
    _assert_equal_outputs(str(reference["root"] / "from_hf"), reference)
    with open(os.path.join(d, "config.json"), "w") as file:
        json.dump(_config_json(model_type="albert", hidden_act="gelu_new", embedding_size=12),
                  file)
    with pytest.raises(UsageError, match=r"hf/model\.safetensors: albert\.embeddings\.word_emb"
                                         r"eddings\.weight has shape \(101, 10\) .* \(101, 12\)"):
        _convert(d, reference["root"] / "bad")


def _tf_albert_weight(pt_name, value):
    """transformers' TF ALBERT spelling (modeling_tf_albert.py) of a PyTorch
    AlbertForPreTraining tensor: (top-level layer, TF name below the model, stored value).
    Layers albert, predictions, sop_classifier; albert_layer_groups.g / albert_layers.i are
    albert_layer_groups_._g / albert_layers_._i; Dense kernels (in, out); the word table is
    `weight`, the other tables `embeddings`; LayerNorms gamma/beta."""
    scope, leaf = pt_name.rsplit(".", 1)
    scope = re.sub(r"(albert_layer_groups|albert_layers)/(\d+)", r"\1_._\2",
                   scope.replace(".", "/"))
    if "LayerNorm" in scope or scope.endswith("layer_norm"):
        leaf = {"weight": "gamma", "bias": "beta"}[leaf]
    elif scope.endswith(("position_embeddings", "token_type_embeddings")):
        leaf = "embeddings"
    elif leaf == "weight" and not scope.endswith("word_embeddings"):
        leaf, value = "kernel", value.T
    return scope.split("/")[0], f"{scope}/{leaf}", value


@pytest.mark.parametrize("weights_file", ["tf_model.h5", "model.safetensors"])
def test_huggingface_tf_weights_with_heads(reference, write_tf_model_h5, write_tf_safetensors,
                                           tmp_path, weights_file):
    """transformers' TF weights (TFAlbertForPreTraining: layers albert, predictions,
    sop_classifier), as tf_model.h5 or as the TF-named model.safetensors of
    save_pretrained(safe_serialization=True): keras-hub's outputs, heads in place."""
    tensors = _hf_tensors(reference["weights"])
    rng = np.random.default_rng(10)
    heads = {"predictions.bias": (101,), "predictions.decoder.bias": (101,),
             "predictions.dense.weight": (E, H), "predictions.dense.bias": (E,),
             "predictions.LayerNorm.weight": (E,), "predictions.LayerNorm.bias": (E,),
             "sop_classifier.classifier.weight": (2, H), "sop_classifier.classifier.bias": (2,)}
    tensors.update({n: rng.normal(size=s).astype("float32") for n, s in heads.items()})
    layers = {}
    for name, value in tensors.items():
        layer, tf_name, stored = _tf_albert_weight(name, value)
        layers.setdefault(layer, {})[tf_name] = stored
    d = tmp_path / "albert_tf"
    os.makedirs(d)
    h5 = weights_file == "tf_model.h5"
    write = write_tf_model_h5 if h5 else write_tf_safetensors
    written = write(d / weights_file, "tf_albert_for_pre_training", layers)
    assert ("tf_albert_for_pre_training/" if h5 else "") + (
        "albert/encoder/albert_layer_groups_._1/albert_layers_._0/attention/query/kernel:0") \
        in written
    with open(d / "config.json", "w") as file:
        json.dump(_config_json(model_type="albert", hidden_act="gelu_new"), file)
    shutil.copyfile(reference["spm"], d / "spiece.model")
    _convert(d, tmp_path / "run")
    _assert_equal_outputs(str(tmp_path / "run"), reference)
    weights = run_dir.read_weights(tmp_path / "run")
    np.testing.assert_array_equal(weights["mlm_head/dense/kernel"],
                                  tensors["predictions.dense.weight"].T)
    np.testing.assert_array_equal(weights["mlm_head/bias"], tensors["predictions.bias"])
    np.testing.assert_array_equal(weights["sop_head/kernel"],
                                  tensors["sop_classifier.classifier.weight"].T)


def test_google_checkpoint_with_pretraining_heads(reference):
    w, d = reference["weights"], str(reference["root"] / "albert_base")
    g = {"bert/embeddings/word_embeddings": w["token_embedding/embeddings"],
         "bert/embeddings/position_embeddings": w["position_embedding/embeddings"],
         "bert/embeddings/token_type_embeddings": w["segment_embedding/embeddings"],
         "bert/embeddings/LayerNorm/gamma": w["embeddings_layer_norm/gamma"],
         "bert/embeddings/LayerNorm/beta": w["embeddings_layer_norm/beta"],
         "bert/encoder/embedding_hidden_mapping_in/kernel": w["embedding_projection/kernel"],
         "bert/encoder/embedding_hidden_mapping_in/bias": w["embedding_projection/bias"],
         "bert/pooler/dense/kernel": w["pooled_dense/kernel"],
         "bert/pooler/dense/bias": w["pooled_dense/bias"]}
    names = {"query": "attention_1/self/query", "key": "attention_1/self/key",
             "value": "attention_1/self/value", "dense": "attention_1/output/dense",
             "ffn": "ffn_1/intermediate/dense", "ffn_output": "ffn_1/intermediate/output/dense",
             "ln": "LayerNorm", "ln_1": "LayerNorm_1"}
    for group in range(2):
        for part, (a, b) in _per_layer(w, group).items():
            p = f"bert/encoder/transformer/group_{group}/inner_group_0/{names[part]}/"
            kinds = ("gamma", "beta") if part.startswith("ln") else ("kernel", "bias")
            g[p + kinds[0]], g[p + kinds[1]] = a, b
    rng = np.random.default_rng(9)
    heads = {"cls/predictions/transform/dense/kernel": (H, E),
             "cls/predictions/transform/dense/bias": (E,),
             "cls/predictions/transform/LayerNorm/gamma": (E,),
             "cls/predictions/transform/LayerNorm/beta": (E,),
             "cls/predictions/output_bias": (101,), "cls/seq_relationship/output_weights": (2, H),
             "cls/seq_relationship/output_bias": (2,)}
    g.update({n: rng.normal(size=s).astype("float32") for n, s in heads.items()})
    os.makedirs(d)
    names_sorted = sorted(g)
    tf.raw_ops.SaveV2(prefix=os.path.join(d, "model.ckpt-best"), tensor_names=names_sorted,
                      shape_and_slices=[""] * len(names_sorted),
                      tensors=[g[n] for n in names_sorted])
    with open(os.path.join(d, "albert_config.json"), "w") as file:
        json.dump(_config_json(hidden_act="gelu"), file)
    shutil.copyfile(reference["spm"], os.path.join(d, "30k-clean.model"))
    with pytest.raises(UsageError, match=r"--lowercase=true: applies to BERT's WordPiece"):
        _convert(d, reference["root"] / "from_google", lowercase="true")
    _convert(d, reference["root"] / "from_google")
    _assert_equal_outputs(str(reference["root"] / "from_google"), reference)
    _, tokenizer = pretrained_config(str(reference["root"] / "from_google"))  # tfbig-squad's
    released = spm.SentencePieceProcessor(model_file=reference["spm"])
    assert isinstance(tokenizer, AlbertSentencePiece)  # ALBERT's preparation: lower-cased ids
    assert tokenizer.encode("The QUICK  brown\nfox") == released.EncodeAsIds("the quick brown fox")
    model = AlbertForPretraining(AlbertConfig(**json.load(open(
        reference["root"] / "from_google" / "config.json"))["model_config"]))
    model.build()
    run_dir.assign(model, run_dir.read_weights(reference["root"] / "from_google"))
    np.testing.assert_array_equal(model.mlm_head.dense.kernel.numpy(),
                                  g["cls/predictions/transform/dense/kernel"])
    np.testing.assert_array_equal(model.sop_head.kernel.numpy(),
                                  g["cls/seq_relationship/output_weights"].T)
    _convert(reference["root"] / "from_google", reference["root"] / "google_hf", to="huggingface")
    _convert(reference["root"] / "google_hf", reference["root"] / "google_back")
    first = run_dir.read_weights(reference["root"] / "from_google")
    second = run_dir.read_weights(reference["root"] / "google_back")
    assert sorted(first) == sorted(second) and "sop_head/kernel" in first  # heads go round too
    assert all(np.array_equal(first[k], second[k]) for k in first)
    os.remove(os.path.join(d, "30k-clean.model"))
    with pytest.raises(UsageError, match=r"albert_base/30k-clean\.model: file not found"):
        _convert(d, reference["root"] / "bad_google")
    for name in os.listdir(d):
        if name.startswith("model.ckpt"):
            os.remove(os.path.join(d, name))
    with pytest.raises(UsageError, match=r"albert_base/model\.ckpt\*\.index: expected one TF1 "
                                         r"checkpoint, found none"):
        _convert(d, reference["root"] / "bad_google")
