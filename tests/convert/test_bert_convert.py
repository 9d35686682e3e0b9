"""BERT in and out of the formats users download: each written by an independent writer
(keras-hub's own preset saver; Hugging Face tensor names written here from a keras-hub BERT's
weights with `safetensors`, and checked by loading them with keras-hub's Hugging Face converter;
the Google TF1 names written with TensorFlow's checkpoint writer), converted by tfbig-convert,
and compared with keras-hub's BertBackbone on the same weights (fp32, 1e-5).

Odd sizes (hidden 36, 3 heads of 12, intermediate 52, vocab 101) exercise head splits and
transposes.
"""
import json
import os
import re
import shutil

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file, save_file

from tfbig.commands.convert import ConvertOptions, convert
from tfbig.convert import bert_names, run_dir
from tfbig.errors import UsageError
from tfbig.models.bert import BertForPretraining, BertForQuestionAnswering
from tfbig.data.wordpiece import WordPieceTokenizer

SIZES = dict(vocabulary_size=101, num_layers=2, num_heads=3, hidden_dim=36, intermediate_dim=52,
             max_sequence_length=40, num_segments=2)
HIDDEN = SIZES["hidden_dim"]
TEXT = ("Héllo, wörld!! Ça va? «Quoi»—naïve café... 東京は晴れ。 "
        "Привет, мир! 42.5% (a+b)=c; "
        "e-mail: x@y.z #tag $5 ~ `q` ÜNÏCÖDÉ")


def _vocab(path):
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "wor", "##ld", "ca", "va",
              "na", "##ive", "caf", "##e", "42", "5", "mail", "tag", "##l", "##o"]
    chars = sorted({c for c in TEXT + TEXT.lower() if not c.isspace()})
    pieces = list(dict.fromkeys(pieces + chars + ["##" + c for c in chars]))
    pieces = (pieces + [f"extra{i}" for i in range(101)])[:101]
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n".join(pieces) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random keras-hub BERT, its vocabulary and its outputs on a padded batch."""
    keras.utils.set_random_seed(3)
    root = tmp_path_factory.mktemp("bert")
    backbone = keras_hub.models.BertBackbone(**SIZES)
    for weight in backbone.weights:  # LayerNorms away from 1/0, so a swap would show
        weight.assign(np.random.default_rng(len(weight.path)).normal(
            0.0, 0.3 if "norm" not in weight.path else 1.0, weight.shape).astype("float32"))
    rng = np.random.default_rng(0)
    inputs = {"token_ids": rng.integers(0, 101, (2, 11)).astype("int32"),
              "segment_ids": (np.arange(11)[None] >= 5).astype("int32").repeat(2, 0),
              "padding_mask": (np.arange(11)[None] < np.array([[11], [7]])).astype("int32")}
    outputs = {k: np.asarray(v) for k, v in backbone(inputs).items()}
    return {"root": root, "backbone": backbone, "vocab": _vocab(str(root / "vocab.txt")),
            "inputs": inputs, "outputs": outputs}


def _tfbig_outputs(run, inputs):
    config, _ = run_dir.read_config(run)
    model = BertForQuestionAnswering(config)
    model.build()
    run_dir.restore_backbone(model, run)
    sequence, pooled = model.backbone(inputs["token_ids"], inputs["segment_ids"],
                                      inputs["padding_mask"])
    return np.asarray(sequence), np.asarray(pooled)


def _assert_equal_outputs(run, reference):
    sequence, pooled = _tfbig_outputs(run, reference["inputs"])
    real = reference["inputs"]["padding_mask"].astype(bool)  # padded positions are don't-care
    np.testing.assert_allclose(sequence[real], reference["outputs"]["sequence_output"][real],
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(pooled, reference["outputs"]["pooled_output"], atol=1e-5,
                               rtol=1e-5)


def _convert(source, output_dir, **kwargs):
    return convert(ConvertOptions(source=str(source), output_dir=str(output_dir), **kwargs))


def _write_hf(reference, directory, hidden_act="gelu_new"):
    """Hugging Face BertModel names from keras-hub weights (written here, not by tfbig)."""
    w = {x.path: np.asarray(x.numpy()) for x in reference["backbone"].weights}
    h = HIDDEN
    t = {"embeddings.word_embeddings.weight": w["token_embedding/embeddings"],
         "embeddings.position_embeddings.weight": w["position_embedding/embeddings"],
         "embeddings.token_type_embeddings.weight": w["segment_embedding/embeddings"],
         "embeddings.LayerNorm.weight": w["embeddings_layer_norm/gamma"],
         "embeddings.LayerNorm.bias": w["embeddings_layer_norm/beta"],
         "pooler.dense.weight": w["pooled_dense/kernel"].T,
         "pooler.dense.bias": w["pooled_dense/bias"]}
    for i in range(SIZES["num_layers"]):
        k, p = f"transformer_layer_{i}/", f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            t[f"{p}attention.self.{name}.weight"] = \
                w[f"{k}self_attention_layer/{name}/kernel"].reshape(h, h).T
            t[f"{p}attention.self.{name}.bias"] = \
                w[f"{k}self_attention_layer/{name}/bias"].reshape(h)
        t[p + "attention.output.dense.weight"] = \
            w[k + "self_attention_layer/attention_output/kernel"].reshape(h, h).T
        t[p + "attention.output.dense.bias"] = w[k + "self_attention_layer/attention_output/bias"]
        t[p + "attention.output.LayerNorm.weight"] = w[k + "self_attention_layer_norm/gamma"]
        t[p + "attention.output.LayerNorm.bias"] = w[k + "self_attention_layer_norm/beta"]
        t[p + "intermediate.dense.weight"] = w[k + "feedforward_intermediate_dense/kernel"].T
        t[p + "intermediate.dense.bias"] = w[k + "feedforward_intermediate_dense/bias"]
        t[p + "output.dense.weight"] = w[k + "feedforward_output_dense/kernel"].T
        t[p + "output.dense.bias"] = w[k + "feedforward_output_dense/bias"]
        t[p + "output.LayerNorm.weight"] = w[k + "feedforward_layer_norm/gamma"]
        t[p + "output.LayerNorm.bias"] = w[k + "feedforward_layer_norm/beta"]
    os.makedirs(directory)
    save_file({n: np.ascontiguousarray(v) for n, v in t.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "bert", "vocab_size": 101, "hidden_size": h,
              "num_hidden_layers": SIZES["num_layers"], "num_attention_heads": 3,
              "intermediate_size": 52, "max_position_embeddings": 40, "type_vocab_size": 2,
              "hidden_act": hidden_act, "layer_norm_eps": 1e-12}
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as file:
        json.dump({"do_lower_case": True}, file)
    shutil.copyfile(reference["vocab"], os.path.join(directory, "vocab.txt"))
    return directory


def _write_google(reference, directory, heads):
    """The original TF1 release layout, written with TensorFlow's checkpoint writer."""
    hf = {x.path: np.asarray(x.numpy()) for x in reference["backbone"].weights}
    h, g = HIDDEN, {}
    g["bert/embeddings/word_embeddings"] = hf["token_embedding/embeddings"]
    g["bert/embeddings/position_embeddings"] = hf["position_embedding/embeddings"]
    g["bert/embeddings/token_type_embeddings"] = hf["segment_embedding/embeddings"]
    g["bert/embeddings/LayerNorm/gamma"] = hf["embeddings_layer_norm/gamma"]
    g["bert/embeddings/LayerNorm/beta"] = hf["embeddings_layer_norm/beta"]
    g["bert/pooler/dense/kernel"] = hf["pooled_dense/kernel"]
    g["bert/pooler/dense/bias"] = hf["pooled_dense/bias"]
    for i in range(SIZES["num_layers"]):
        k, p = f"transformer_layer_{i}/", f"bert/encoder/layer_{i}/"
        for name in ("query", "key", "value"):
            g[f"{p}attention/self/{name}/kernel"] = \
                hf[f"{k}self_attention_layer/{name}/kernel"].reshape(h, h)
            g[f"{p}attention/self/{name}/bias"] = \
                hf[f"{k}self_attention_layer/{name}/bias"].reshape(h)
        g[p + "attention/output/dense/kernel"] = \
            hf[k + "self_attention_layer/attention_output/kernel"].reshape(h, h)
        g[p + "attention/output/dense/bias"] = hf[k + "self_attention_layer/attention_output/bias"]
        g[p + "attention/output/LayerNorm/gamma"] = hf[k + "self_attention_layer_norm/gamma"]
        g[p + "attention/output/LayerNorm/beta"] = hf[k + "self_attention_layer_norm/beta"]
        g[p + "intermediate/dense/kernel"] = hf[k + "feedforward_intermediate_dense/kernel"]
        g[p + "intermediate/dense/bias"] = hf[k + "feedforward_intermediate_dense/bias"]
        g[p + "output/dense/kernel"] = hf[k + "feedforward_output_dense/kernel"]
        g[p + "output/dense/bias"] = hf[k + "feedforward_output_dense/bias"]
        g[p + "output/LayerNorm/gamma"] = hf[k + "feedforward_layer_norm/gamma"]
        g[p + "output/LayerNorm/beta"] = hf[k + "feedforward_layer_norm/beta"]
    rng = np.random.default_rng(5)
    g.update({name: rng.normal(size=shape).astype("float32") for name, shape in heads.items()})
    g["global_step"] = np.array(7, np.int64)  # the releases carry it; not a weight
    os.makedirs(directory)
    names = sorted(g)
    tf.raw_ops.SaveV2(prefix=os.path.join(directory, "bert_model.ckpt"), tensor_names=names,
                      shape_and_slices=[""] * len(names), tensors=[g[n] for n in names])
    config = {"vocab_size": 101, "hidden_size": h, "num_hidden_layers": SIZES["num_layers"],
              "num_attention_heads": 3, "intermediate_size": 52, "hidden_act": "gelu",
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
              "max_position_embeddings": 40, "type_vocab_size": 2, "initializer_range": 0.02}
    with open(os.path.join(directory, "bert_config.json"), "w") as file:
        json.dump(config, file)
    shutil.copyfile(reference["vocab"], os.path.join(directory, "vocab.txt"))
    return g


GOOGLE_HEADS = {"cls/predictions/transform/dense/kernel": (HIDDEN, HIDDEN),
                "cls/predictions/transform/dense/bias": (HIDDEN,),
                "cls/predictions/transform/LayerNorm/gamma": (HIDDEN,),
                "cls/predictions/transform/LayerNorm/beta": (HIDDEN,),
                "cls/predictions/output_bias": (101,),
                "cls/seq_relationship/output_weights": (2, HIDDEN),
                "cls/seq_relationship/output_bias": (2,)}


def test_keras_hub_preset(reference):
    preset = str(reference["root"] / "preset")
    reference["backbone"].save_to_preset(preset)
    keras_hub.tokenizers.BertTokenizer(vocabulary=reference["vocab"],
                                       lowercase=True).save_to_preset(preset)
    _convert(preset, reference["root"] / "from_keras_hub")
    _assert_equal_outputs(str(reference["root"] / "from_keras_hub"), reference)


def test_huggingface_directory_and_export_round_trip(reference):
    root = reference["root"]
    hf = _write_hf(reference, str(root / "hf"))
    # the file is what keras-hub's own Hugging Face converter reads as this model
    loaded = keras_hub.models.BertBackbone.from_preset(hf)
    np.testing.assert_allclose(loaded(reference["inputs"])["pooled_output"],
                               reference["outputs"]["pooled_output"], atol=1e-6)
    _convert(hf, root / "from_hf")
    _assert_equal_outputs(str(root / "from_hf"), reference)
    # export -> keras-hub reads it with equal outputs; re-import is bit-exact
    with pytest.raises(UsageError, match="--format and --lowercase describe an import"):
        _convert(root / "from_hf", root / "exported", to="huggingface", lowercase="false")
    _convert(root / "from_hf", root / "exported", to="huggingface")
    exported = keras_hub.models.BertBackbone.from_preset(str(root / "exported"))
    for key, value in exported(reference["inputs"]).items():
        real = reference["inputs"]["padding_mask"].astype(bool) if key == "sequence_output" \
            else slice(None)
        np.testing.assert_allclose(np.asarray(value)[real], reference["outputs"][key][real],
                                   atol=1e-5, rtol=1e-5)
    _convert(root / "exported", root / "reimported")
    first, second = run_dir.read_weights(root / "from_hf"), run_dir.read_weights(
        root / "reimported")
    assert sorted(first) == sorted(second)
    assert all(np.array_equal(first[k], second[k]) for k in first)


def _tf_bert_weight(pt_name, value):
    """transformers' TF BERT spelling (modeling_tf_bert.py) of a PyTorch BertForPreTraining
    tensor: (top-level layer, TF name below the model, stored value). Layers bert, mlm___cls,
    nsp___cls; encoder.layer.i is encoder/layer_._i; Dense kernels (in, out); the word table is
    `weight`, the position and token-type tables `embeddings`; LayerNorms gamma/beta."""
    scope, leaf = pt_name.rsplit(".", 1)
    scope = re.sub(r"layer/(\d+)", r"layer_._\1", scope.replace(".", "/"))
    layer = "bert"
    if scope.startswith("cls/"):
        layer = "nsp___cls" if scope == "cls/seq_relationship" else "mlm___cls"
        scope = scope[len("cls/"):]
    if "LayerNorm" in scope:
        leaf = {"weight": "gamma", "bias": "beta"}[leaf]
    elif scope.endswith(("position_embeddings", "token_type_embeddings")):
        leaf = "embeddings"
    elif leaf == "weight" and not scope.endswith("word_embeddings"):
        leaf, value = "kernel", value.T
    return layer, f"{layer}/{scope}/{leaf}", value


@pytest.mark.parametrize("weights_file", ["tf_model.h5", "model.safetensors"])
def test_huggingface_tf_weights_with_heads(reference, write_tf_model_h5, write_tf_safetensors,
                                           tmp_path, weights_file):
    """transformers' TF weights (TFBertForPreTraining: layers bert, mlm___cls, nsp___cls), as
    tf_model.h5 or as the TF-named model.safetensors of save_pretrained(safe_serialization=
    True), instead of a PyTorch model.safetensors: keras-hub's outputs, the heads where tfbig
    reads them."""
    hf = _write_hf(reference, str(tmp_path / "hf"))
    tensors = dict(load_file(os.path.join(hf, "model.safetensors")))
    os.remove(os.path.join(hf, "model.safetensors"))
    rng = np.random.default_rng(6)
    heads = {"cls.predictions.bias": (101,), "cls.predictions.transform.dense.weight":
             (HIDDEN, HIDDEN), "cls.predictions.transform.dense.bias": (HIDDEN,),
             "cls.predictions.transform.LayerNorm.weight": (HIDDEN,),
             "cls.predictions.transform.LayerNorm.bias": (HIDDEN,),
             "cls.seq_relationship.weight": (2, HIDDEN), "cls.seq_relationship.bias": (2,)}
    tensors.update({n: rng.normal(size=s).astype("float32") for n, s in heads.items()})
    layers = {}
    for name, value in tensors.items():
        layer, tf_name, stored = _tf_bert_weight(name, value)
        layers.setdefault(layer, {})[tf_name] = stored
    h5 = weights_file == "tf_model.h5"
    write = write_tf_model_h5 if h5 else write_tf_safetensors
    written = write(os.path.join(hf, weights_file), "tf_bert_for_pre_training", layers)
    scope = "tf_bert_for_pre_training/" if h5 else ""  # the TF safetensors drop the model's
    assert {f"{scope}bert/encoder/layer_._1/attention/self/query/kernel:0",
            f"{scope}mlm___cls/predictions/transform/LayerNorm/gamma:0",
            f"{scope}bert/embeddings/token_type_embeddings/embeddings:0"} <= set(written)
    _convert(hf, tmp_path / "run")
    _assert_equal_outputs(str(tmp_path / "run"), reference)
    weights = run_dir.read_weights(tmp_path / "run")
    np.testing.assert_array_equal(weights["nsp_head/kernel"],
                                  tensors["cls.seq_relationship.weight"].T)
    np.testing.assert_array_equal(weights["mlm_head/dense/kernel"],
                                  tensors["cls.predictions.transform.dense.weight"].T)
    np.testing.assert_array_equal(weights["mlm_head/bias"], tensors["cls.predictions.bias"])
    if not h5:  # not a safetensors file; a Flax one: clear errors naming it
        save_file({"bert.kernel": np.zeros(2, "float32")}, os.path.join(hf, weights_file),
                  metadata={"format": "flax"})
        with pytest.raises(UsageError, match=r"hf/model\.safetensors: a flax safetensors file"):
            _convert(hf, tmp_path / "bad")
        with open(os.path.join(hf, weights_file), "wb") as file:
            file.write(b"not safetensors")
        with pytest.raises(UsageError, match=r"hf/model\.safetensors: not a safetensors file"):
            _convert(hf, tmp_path / "bad")
        return
    # a file that is not HDF5, and an HDF5 file without Keras' layer list: clear errors
    with open(os.path.join(hf, "tf_model.h5"), "wb") as file:
        file.write(b"not hdf5")
    with pytest.raises(UsageError, match=r"hf/tf_model\.h5: not an HDF5 file"):
        _convert(hf, tmp_path / "bad")
    import h5py
    with h5py.File(os.path.join(hf, "tf_model.h5"), "w") as file:
        file.create_dataset("bert/kernel", data=np.zeros(2))
    with pytest.raises(UsageError, match=r"hf/tf_model\.h5: no 'layer_names' attribute"):
        _convert(hf, tmp_path / "bad")


def test_huggingface_erf_gelu(reference):
    """Hugging Face's "gelu" is the erf form: keras-hub's BERT with its feed-forward activation
    set to the erf GELU is the reference; the export writes "gelu" back."""
    root = reference["root"]
    _convert(_write_hf(reference, str(root / "hf_erf"), hidden_act="gelu"), root / "erf")
    backbone = keras_hub.models.BertBackbone(**SIZES)
    backbone.set_weights(reference["backbone"].get_weights())
    for i in range(SIZES["num_layers"]):
        dense = backbone.get_layer(f"transformer_layer_{i}")._feedforward_intermediate_dense
        dense.activation = lambda x: keras.activations.gelu(x, approximate=False)
    erf = {k: np.asarray(v) for k, v in backbone(reference["inputs"]).items()}
    assert np.abs(erf["pooled_output"] - reference["outputs"]["pooled_output"]).max() > 1e-4
    _assert_equal_outputs(str(root / "erf"), {**reference, "outputs": erf})
    _convert(root / "erf", root / "erf_hf", to="huggingface")
    with open(root / "erf_hf" / "config.json") as file:
        assert json.load(file)["hidden_act"] == "gelu"


def test_google_checkpoint_with_pretraining_heads(reference):
    root = reference["root"]
    google = _write_google(reference, str(root / "uncased_L-2_H-36_A-3"), GOOGLE_HEADS)
    _convert(root / "uncased_L-2_H-36_A-3", root / "from_google")
    _assert_equal_outputs(str(root / "from_google"), reference)
    config, saved = run_dir.read_config(root / "from_google")
    assert saved["tokenizer"]["lowercase"] is True
    # the heads land where BertForPretraining reads them: NSP kernel transposed, MLM tied
    model = BertForPretraining(config)
    model.build()
    run_dir.assign(model, run_dir.read_weights(root / "from_google"))
    np.testing.assert_array_equal(model.nsp_head.kernel.numpy(),
                                  google["cls/seq_relationship/output_weights"].T)
    np.testing.assert_array_equal(model.mlm_head.bias.numpy(),
                                  google["cls/predictions/output_bias"])
    # export with heads -> Google names back, bit for bit
    weights = run_dir.read_weights(root / "from_google")
    back = bert_names.tfbig_to_google(weights, config.num_layers)
    assert all(np.array_equal(back[n], google[n]) for n in back)
    assert set(google) - set(back) == {"global_step"}


def test_wordpiece_ids_equal_keras_hub(reference):
    for lowercase in (True, False):
        ours = WordPieceTokenizer(reference["vocab"], lowercase).encode(TEXT)
        theirs = keras_hub.tokenizers.BertTokenizer(
            vocabulary=reference["vocab"], lowercase=lowercase, strip_accents=lowercase)(TEXT)
        assert ours == [int(i) for i in theirs]
        assert len(set(ours)) > 20 and ours.count(1) < len(ours) // 4  # real pieces, few [UNK]


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

    torch_only = tmp_path / "torch_only"
    shutil.copytree(hf, torch_only)
    os.rename(torch_only / "model.safetensors", torch_only / "pytorch_model.bin")
    fails(torch_only, r"model\.safetensors: file not found \(found \['pytorch_model\.bin'\]")
    no_vocab = tmp_path / "no_vocab"
    shutil.copytree(hf, no_vocab)
    os.remove(no_vocab / "vocab.txt")
    fails(no_vocab, r"no_vocab/vocab\.txt: file not found")
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(hf, gpt2)
    _edit_json(gpt2 / "config.json", model_type="gpt2")
    fails(gpt2, r"gpt2/config\.json: missing \['n_positions', .*expected a GPT-2 config")
    _edit_json(gpt2 / "config.json", model_type="albert")  # an ALBERT config over BERT files
    fails(gpt2, r"gpt2/config\.json: missing \['embedding_size'\]; expected an ALBERT config")
    shape = tmp_path / "shape"
    shutil.copytree(hf, shape)
    _edit_json(shape / "config.json", intermediate_size=64)
    fails(shape, r"shape/model\.safetensors: bert\.encoder\.layer\.0\.intermediate\.dense\.weight"
                 r" has shape \(52, 36\) but the config .* implies \(64, 36\)")
    vocab = tmp_path / "vocab"
    shutil.copytree(hf, vocab)
    with open(vocab / "vocab.txt", "a") as file:
        file.write("surplus\n")
    fails(vocab, r"vocab/vocab\.txt: 102 word pieces, but .*config\.json says vocab_size=101")
    fails(tmp_path / "missing", r"missing: not a directory")
    google = tmp_path / "plain_name"
    _write_google(reference, str(google), {})
    fails(google, r"cannot tell .* cased; give --lowercase")
    os.remove(google / "bert_model.ckpt.index")
    fails(google, r"bert_model\.ckpt\.index: file not found", lowercase="true")
