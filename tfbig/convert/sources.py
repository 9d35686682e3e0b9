"""Read a BERT or ALBERT published in someone else's on-disk format: config, weights, tokenizer.

Why it is built this way: docs/design/notes/convert.md (tfbig.convert.sources).
"""
import dataclasses
import json
import os

import numpy as np

from tfbig.convert import bert_names, hf_h5
from tfbig.errors import UsageError
from tfbig.models.configs import BertConfig

FORMATS = ("huggingface", "keras_hub", "google")


@dataclasses.dataclass
class Published:
    """A BERT read from disk, in the pivot (Google TF1) naming."""

    config: BertConfig
    weights: dict  # {Google TF1 name: np.ndarray}
    vocab_file: str  # BERT: WordPiece vocab.txt; ALBERT: SentencePiece model
    lowercase: bool
    source: str  # "<format>:<path>", recorded in the converted run's config.json
    family: str = "bert"  # "bert" | "albert": the run's model_format


def _json(path):
    if not os.path.isfile(path):
        raise UsageError(f"{path}: file not found")
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def detect(directory):
    """Which format `directory` holds, from the files present; a clear error if none."""
    def has(name):
        return os.path.exists(os.path.join(directory, name))

    if not os.path.isdir(directory):
        raise UsageError(f"--source={directory}: not a directory")
    if has("bert_config.json") or has("albert_config.json"):
        return "google"
    if has("model.weights.h5") or has("metadata.json"):
        return "keras_hub"
    if has("config.json"):
        return "huggingface"
    raise UsageError(f"--source={directory}: no config.json (Hugging Face or keras-hub), "
                     f"bert_config.json or albert_config.json (Google TF1) in it; found "
                     f"{sorted(os.listdir(directory))}")


def _hf_config(config, path, tanh_gelu=False):
    """BertConfig from a Hugging Face / Google bert_config.json dict. Hugging Face's "gelu" is
    the erf form; the Google TF1 code computes the tanh form whatever its config says
    (`tanh_gelu`)."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "max_position_embeddings")
    missing = [k for k in keys if k not in config]
    if missing:
        raise UsageError(f"{path}: missing {missing}; expected a BERT config")
    act = config.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise UsageError(f"{path}: hidden_act={act!r}; tfbig's BERT computes GELU (gelu, "
                         "gelu_new or gelu_pytorch_tanh)")
    return BertConfig(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        seq_length=config["max_position_embeddings"],
        type_vocab_size=config.get("type_vocab_size", 2),
        dropout=config.get("hidden_dropout_prob", 0.1),
        layer_norm_epsilon=config.get("layer_norm_eps", 1e-12),
        initializer_range=config.get("initializer_range", 0.02),
        approximate_gelu=act != "gelu" or tanh_gelu)


def check_weights(published, weights_file, name_of=lambda google: (google, False),
                  expected=None):
    """Every backbone tensor present with the shape the config implies (`expected`, Google
    name -> shape; BERT's by default); else an error naming the weights file, the tensor and
    its shape as that file stores them (`name_of`: Google name -> (the file's name, whether the
    file stores it transposed)) and the config's fields."""
    cfg = published.config
    expected = bert_names.google_shapes(cfg) if expected is None else expected
    missing = [name_of(n)[0] for n in expected if n not in published.weights
               and not n.startswith("cls/")]
    if missing:
        raise UsageError(f"{weights_file}: {len(missing)} BERT tensors missing for num_layers="
                         f"{cfg.num_layers}, e.g. {missing[:3]}")
    for name, shape in expected.items():
        found = tuple(published.weights[name].shape) if name in published.weights else shape
        if found != shape:
            file_name, transposed = name_of(name)
            if transposed:
                found, shape = found[::-1], shape[::-1]
            raise UsageError(
                f"{weights_file}: {file_name} has shape {found} but the config (vocab_size="
                f"{cfg.vocab_size}, hidden_size={cfg.hidden_size}, intermediate_size="
                f"{cfg.intermediate_size}, seq_length={cfg.seq_length}{_embedding(published)})"
                f" implies {shape}")


def _embedding(published):
    """ALBERT's embedding size, for the shape message."""
    if published.family != "albert":
        return ""
    return f", embedding_size={published.config.embedding_size}"


def check_vocab(vocab_file, config, config_file):
    """The vocabulary has exactly config.vocab_size entries."""
    if not os.path.isfile(vocab_file):
        raise UsageError(f"{vocab_file}: file not found (the WordPiece vocabulary)")
    with open(vocab_file, encoding="utf-8") as file:
        count = sum(1 for _ in file)
    if count != config.vocab_size:
        raise UsageError(f"{vocab_file}: {count} word pieces, but {config_file} says "
                         f"vocab_size={config.vocab_size}; they must come from the same model")


def read_huggingface(directory):
    config_file = os.path.join(directory, "config.json")
    raw = _json(config_file)
    if raw.get("model_type") == "albert":
        return read_albert_huggingface(directory, raw)
    if raw.get("model_type") == "gpt2":
        from tfbig.convert import gpt2
        return gpt2.read_huggingface(directory, raw)
    if raw.get("model_type") != "bert":
        raise UsageError(f"{config_file}: model_type={raw.get('model_type')!r}; tfbig-convert "
                         "reads BERT, ALBERT and GPT-2 (model_type 'bert', 'albert' or 'gpt2')")
    weights_file, tensors = hf_h5.load_weights(directory)
    config = _hf_config(raw, config_file)
    weights = bert_names.hf_to_google(tensors, config.num_layers)
    tokenizer = os.path.join(directory, "tokenizer_config.json")
    lowercase = _json(tokenizer).get("do_lower_case", True) if os.path.isfile(tokenizer) \
        else True  # the default of Hugging Face's BertTokenizer
    published = Published(config, weights, os.path.join(directory, "vocab.txt"), lowercase,
                          f"huggingface:{directory}")
    check_weights(published, weights_file, bert_names.hf_name)
    check_vocab(published.vocab_file, config, config_file)
    return published


def read_keras_hub(directory):
    config_file = os.path.join(directory, "config.json")
    raw = _json(config_file)
    if raw.get("registered_name") == "keras_hub>AlbertBackbone":
        return read_albert_keras_hub(directory, raw)
    if raw.get("registered_name") == "keras_hub>GPT2Backbone":
        from tfbig.convert import gpt2
        return gpt2.read_keras_hub(directory, raw)
    if raw.get("registered_name") != "keras_hub>BertBackbone":
        raise UsageError(f"{config_file}: a {raw.get('registered_name')!r} preset; tfbig-convert "
                         "reads keras_hub>BertBackbone, AlbertBackbone and GPT2Backbone presets")
    import keras_hub

    backbone = keras_hub.models.BertBackbone.from_preset(directory)
    weights = {w.path: np.asarray(w.numpy()) for w in backbone.weights}
    c = raw["config"]
    config = BertConfig(vocab_size=c["vocabulary_size"], hidden_size=c["hidden_dim"],
                        num_layers=c["num_layers"], num_heads=c["num_heads"],
                        intermediate_size=c["intermediate_dim"],
                        seq_length=c["max_sequence_length"], type_vocab_size=c["num_segments"],
                        dropout=c.get("dropout", 0.1))
    tokenizer = _json(os.path.join(directory, "tokenizer.json"))["config"]
    published = Published(
        config, bert_names.keras_hub_to_google(weights, config.num_layers, config.hidden_size),
        os.path.join(directory, "assets", "tokenizer", "vocabulary.txt"),
        tokenizer.get("lowercase", False), f"keras_hub:{directory}")
    check_weights(published, os.path.join(directory, "model.weights.h5"))
    check_vocab(published.vocab_file, config, config_file)
    return published


def read_google(directory, lowercase=None):
    """lowercase: None reads it from the directory name (the releases are named
    uncased_L-12_H-768_A-12 / cased_L-12_H-768_A-12)."""
    import tensorflow as tf

    if os.path.isfile(os.path.join(directory, "albert_config.json")):
        return read_albert_google(directory)
    config_file = os.path.join(directory, "bert_config.json")
    config = _hf_config(_json(config_file), config_file, tanh_gelu=True)
    prefix = os.path.join(directory, "bert_model.ckpt")
    if not os.path.isfile(prefix + ".index"):
        raise UsageError(f"{prefix}.index: file not found (the TF1 checkpoint bert_model.ckpt.*)")
    reader = tf.train.load_checkpoint(prefix)
    weights = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
               if name.startswith(("bert/", "cls/"))}
    if lowercase is None:
        base = os.path.basename(os.path.normpath(directory)).lower()
        if "uncased" not in base and "cased" not in base:
            raise UsageError(f"--source={directory}: cannot tell from the directory name whether "
                             "the vocabulary is cased; give --lowercase=true or false")
        lowercase = "uncased" in base
    published = Published(config, weights, os.path.join(directory, "vocab.txt"), lowercase,
                          f"google:{directory}")
    check_weights(published, prefix)
    check_vocab(published.vocab_file, config, config_file)
    return published


def read(directory, source_format="auto", lowercase=None):
    """The Published BERT in `directory` (format detected unless given)."""
    kind = detect(directory) if source_format == "auto" else source_format
    if kind not in FORMATS:
        raise UsageError(f"--format={source_format!r}: expected auto or one of {FORMATS}")
    if kind == "google":
        return read_google(directory, lowercase)
    published = read_huggingface(directory) if kind == "huggingface" else \
        read_keras_hub(directory)
    if lowercase is not None:
        published.lowercase = lowercase
    return published


def _albert(directory, raw, config_file, weights, weights_file, tokenizer, source, name_of):
    from tfbig.convert import albert

    config = albert.config_from_json(raw, config_file)
    google = weights(config)
    published = Published(config, google, os.path.join(directory, tokenizer), False,
                          f"{source}:{directory}", family="albert")
    check_weights(published, weights_file, name_of, albert.google_shapes(config))
    albert.check_tokenizer(published.vocab_file, config, config_file)
    return published


def read_albert_huggingface(directory, raw):
    """config.json (model_type "albert") + model.safetensors or tf_model.h5 + spiece.model."""
    from tfbig.convert import albert

    weights_file, tensors = hf_h5.load_weights(directory)
    hf_names = {}

    def weights(config):
        rows = albert.table(config.num_groups) + [
            (None, g, h) for _, gs, hs in albert.qkv_table(config.num_groups)
            for g, h in zip(gs, hs)]
        hf_names.update({g: (h, g.endswith("/kernel")) for _, g, h in rows})
        return albert.hf_to_google(tensors, config.num_groups)

    return _albert(directory, raw, os.path.join(directory, "config.json"), weights,
                   weights_file, "spiece.model", "huggingface",
                   lambda google: hf_names.get(google, (google, False)))


def read_albert_google(directory):
    """albert_config.json + model.ckpt*.{index,data-*} + 30k-clean.model."""
    import tensorflow as tf

    config_file = os.path.join(directory, "albert_config.json")
    # The releases name it model.ckpt-best (v2) or model.ckpt-<step>: take the one there is.
    found = sorted(f[:-len(".index")] for f in os.listdir(directory)
                   if f.startswith("model.ckpt") and f.endswith(".index"))
    if len(found) != 1:
        raise UsageError(f"{directory}/model.ckpt*.index: expected one TF1 checkpoint, found "
                         f"{found or 'none'}")
    prefix = os.path.join(directory, found[0])

    def weights(config):
        reader = tf.train.load_checkpoint(prefix)
        return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
                if name.startswith(("bert/", "cls/"))}

    return _albert(directory, _json(config_file), config_file, weights, prefix,
                   "30k-clean.model", "google", lambda google: (google, False))


def read_albert_keras_hub(directory, raw):
    """A keras_hub>AlbertBackbone preset, read with keras-hub."""
    import keras_hub

    from tfbig.convert import albert

    c = raw["config"]
    if c.get("num_inner_repetitions", 1) != 1:
        raise UsageError(f"{directory}/config.json: num_inner_repetitions="
                         f"{c['num_inner_repetitions']}; tfbig's ALBERT runs one layer per group")
    hf_like = {"vocab_size": c["vocabulary_size"], "embedding_size": c["embedding_dim"],
               "hidden_size": c["hidden_dim"], "num_hidden_layers": c["num_layers"],
               "num_hidden_groups": c["num_groups"], "num_attention_heads": c["num_heads"],
               "intermediate_size": c["intermediate_dim"],
               "max_position_embeddings": c["max_sequence_length"],
               "type_vocab_size": c["num_segments"], "hidden_dropout_prob": c.get("dropout", 0.0)}

    def weights(config):
        backbone = keras_hub.models.AlbertBackbone.from_preset(directory)
        return albert.keras_hub_to_google({w.path: np.asarray(w.numpy())
                                           for w in backbone.weights},
                                          config.num_groups, config.hidden_size)

    return _albert(directory, hf_like, os.path.join(directory, "config.json"), weights,
                   os.path.join(directory, "model.weights.h5"),
                   os.path.join("assets", "tokenizer", "vocabulary.spm"), "keras_hub",
                   lambda google: (google, False))
