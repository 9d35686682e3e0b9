"""GPT-2 in and out: Hugging Face and keras-hub GPT-2s into a tfbig GPT run directory, and a
tfbig GPT run back out to a Hugging Face GPT-2 directory.

    huggingface  config.json (model_type "gpt2") + model.safetensors (GPT2Model names, or
                 GPT2LMHeadModel's "transformer."-prefixed ones) or transformers' TF weights
                 tf_model.h5 (tfbig.convert.hf_h5) + vocab.json + merges.txt
    keras_hub    a keras_hub>GPT2Backbone preset (config.json + model.weights.h5, tokenizer.json
                 + assets/tokenizer/vocabulary.json + merges.txt), read with keras-hub itself

The pivot is Hugging Face's naming without the prefix ("h.0.attn.c_attn.weight"). Its Conv1D
weights are stored (in, out), as Keras kernels are, and c_attn is [q | k | v] with each part
head-major, as tfbig's fused qkv kernel is: only an untied lm_head.weight (V, C) is transposed.
GPT-2 is pre-LN with a final ln_f, learned positions, the tanh GELU ("gelu_new") and the output
projection tied to wte: tfbig's GPT with pre_layer_norm=True.

The run directory carries the byte-level BPE tokenizer (vocab.json, merges.txt; config.json
"tokenizer": {"kind": "byte_level_bpe"}), which tfbig-generate reads (tfbig.data.tokenizer.for_run).
"""
import dataclasses
import json
import os
import shutil

import numpy as np

from tfbig.data.bpe import RUN_ENTRY
from tfbig.errors import UsageError
from tfbig.models.configs import GPTConfig

# tfbig key below block_i -> Hugging Face name below h.i
BLOCK = {"ln_1/gamma": "ln_1.weight", "ln_1/beta": "ln_1.bias",
         "attn/qkv/kernel": "attn.c_attn.weight", "attn/qkv/bias": "attn.c_attn.bias",
         "attn/proj/kernel": "attn.c_proj.weight", "attn/proj/bias": "attn.c_proj.bias",
         "ln_2/gamma": "ln_2.weight", "ln_2/beta": "ln_2.bias",
         "mlp/fc/kernel": "mlp.c_fc.weight", "mlp/fc/bias": "mlp.c_fc.bias",
         "mlp/proj/kernel": "mlp.c_proj.weight", "mlp/proj/bias": "mlp.c_proj.bias"}
TOP = {"embedding/token/embeddings": "wte.weight",
       "embedding/position/embeddings": "wpe.weight",
       "final_norm/gamma": "ln_f.weight", "final_norm/beta": "ln_f.bias"}
HEAD = ("head/kernel", "lm_head.weight")  # untied only; stored (V, C), tfbig's kernel (C, V)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
TOKENIZER = RUN_ENTRY  # vocab.json + merges.txt, {"kind": "byte_level_bpe", ...}


@dataclasses.dataclass
class PublishedGPT2:
    """A GPT-2 read from disk, under tfbig's keys."""

    config: GPTConfig
    weights: dict  # {tfbig key: np.ndarray}
    vocab_file: str
    merges_file: str
    source: str  # "<format>:<path>", recorded in the converted run's config.json
    family: str = "gpt"


def names(config):
    """{tfbig key: Hugging Face name (no "transformer." prefix)} of a GPT with `config`."""
    out = dict(TOP)
    for i in range(config.num_layers):
        out.update({f"block_{i}/{key}": f"h.{i}.{hf}" for key, hf in BLOCK.items()})
    if not config.tie_embeddings:
        out[HEAD[0]] = HEAD[1]
    return out


def shapes(config):
    """{tfbig key: shape} that `config` implies."""
    c, i = config.hidden_size, config.intermediate_size
    by_tail = {"embedding/token/embeddings": (config.vocab_size, c),
               "embedding/position/embeddings": (config.seq_length, c),
               "attn/qkv/kernel": (c, 3 * c), "attn/qkv/bias": (3 * c,),
               "attn/proj/kernel": (c, c), "mlp/fc/kernel": (c, i), "mlp/fc/bias": (i,),
               "mlp/proj/kernel": (i, c), HEAD[0]: (c, config.vocab_size)}
    return {key: by_tail.get(key.split("/", 1)[-1] if key.startswith("block_") else key, (c,))
            for key in names(config)}


def config_from_hf(raw, path):
    """GPTConfig from a Hugging Face GPT-2 config.json; what tfbig's GPT cannot compute is
    refused, naming the key."""
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
               if k not in raw]
    if missing:
        raise UsageError(f"{path}: missing {missing}; expected a GPT-2 config")
    act = raw.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        raise UsageError(f"{path}: activation_function={act!r}; tfbig's GPT computes the tanh "
                         f"GELU ({' or '.join(TANH_GELU)})")
    unsupported = {"scale_attn_weights": (True, "scores are always divided by sqrt(head size)"),
                   "scale_attn_by_inverse_layer_idx": (False, "no per-layer score scaling"),
                   "add_cross_attention": (False, "a decoder without cross-attention")}
    for key, (value, why) in unsupported.items():
        if raw.get(key, value) != value:
            raise UsageError(f"{path}: {key}={raw[key]}; tfbig's GPT has {why} ({key}={value})")
    drops = {k: raw.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        raise UsageError(f"{path}: {drops}; tfbig's GPT has one dropout rate for all three")
    try:
        return GPTConfig(vocab_size=raw["vocab_size"], seq_length=raw["n_positions"],
                         num_layers=raw["n_layer"], hidden_size=raw["n_embd"],
                         num_heads=raw["n_head"], intermediate_size=raw.get("n_inner") or 0,
                         dropout=drops["resid_pdrop"],
                         layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5),
                         pre_layer_norm=True,
                         tie_embeddings=raw.get("tie_word_embeddings", True),
                         initializer_range=raw.get("initializer_range", 0.02))
    except ValueError as error:
        raise UsageError(f"{path}: {error}") from error


def hf_config(config, eos_id):
    """The Hugging Face config.json of a tfbig GPT (GPT2LMHeadModel)."""
    inner = None if config.intermediate_size == 4 * config.hidden_size else \
        config.intermediate_size
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": config.vocab_size, "n_positions": config.seq_length,
            "n_ctx": config.seq_length, "n_embd": config.hidden_size,
            "n_layer": config.num_layers, "n_head": config.num_heads, "n_inner": inner,
            "activation_function": "gelu_new", "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range, "scale_attn_weights": True,
            "tie_word_embeddings": config.tie_embeddings,
            "bos_token_id": eos_id, "eos_token_id": eos_id}


def hf_to_tfbig(tensors, config, weights_file):
    """{Hugging Face name: array} -> {tfbig key: array}; a missing tensor or a shape the config
    does not imply is an error naming `weights_file`, the tensor and the config's keys."""
    prefix = "transformer." if any(n.startswith("transformer.") for n in tensors) else ""
    expected = shapes(config)
    out = {}
    for key, hf in names(config).items():
        stored = hf if key == HEAD[0] else prefix + hf
        if stored not in tensors:
            raise UsageError(f"{weights_file}: no {stored}, which a GPT-2 with n_layer="
                             f"{config.num_layers}, tie_word_embeddings={config.tie_embeddings}"
                             " has")
        value = tensors[stored].T if key == HEAD[0] else tensors[stored]
        if tuple(value.shape) != expected[key]:
            shown = (value.shape[::-1], expected[key][::-1]) if key == HEAD[0] else \
                (value.shape, expected[key])
            raise UsageError(
                f"{weights_file}: {stored} has shape {tuple(shown[0])} but the config "
                f"(vocab_size={config.vocab_size}, n_positions={config.seq_length}, n_embd="
                f"{config.hidden_size}, n_inner={config.intermediate_size}) implies "
                f"{tuple(shown[1])}")
        out[key] = np.asarray(value, np.float32)
    return out


def check_tokenizer(vocab_file, merges_file, config, config_file):
    """The BPE files load and have exactly config.vocab_size tokens."""
    from tfbig.data.bpe import ByteLevelBPE

    try:
        tokenizer = ByteLevelBPE.load(vocab_file, merges_file)
    except ValueError as error:
        raise UsageError(str(error)) from error
    if tokenizer.vocab_size != config.vocab_size:
        raise UsageError(f"{vocab_file}: {tokenizer.vocab_size} tokens, but {config_file} says "
                         f"vocab_size={config.vocab_size}; they must come from the same model")


def read_huggingface(directory, raw):
    """config.json (model_type "gpt2") + model.safetensors or tf_model.h5 + vocab.json +
    merges.txt."""
    from tfbig.convert import hf_h5

    config_file = os.path.join(directory, "config.json")
    config = config_from_hf(raw, config_file)
    weights_file, tensors = hf_h5.load_weights(directory)
    weights = hf_to_tfbig(tensors, config, weights_file)
    published = PublishedGPT2(config, weights, os.path.join(directory, "vocab.json"),
                              os.path.join(directory, "merges.txt"), f"huggingface:{directory}")
    check_tokenizer(published.vocab_file, published.merges_file, config, config_file)
    return published


def keras_hub_to_hf(weights, num_layers, hidden_size):
    """{keras-hub GPT2Backbone weight path: array} -> {Hugging Face name: array}."""
    h = hidden_size
    out = {"wte.weight": weights["token_embedding/embeddings"],
           "wpe.weight": weights["position_embedding/embeddings"],
           "ln_f.weight": weights["layer_norm/gamma"], "ln_f.bias": weights["layer_norm/beta"]}
    for i in range(num_layers):
        k, p = f"transformer_layer_{i}/", f"h.{i}."
        attn = k + "self_attention/"
        out[p + "attn.c_attn.weight"] = np.concatenate(  # (C, nh, hs) each -> (C, 3C)
            [weights[f"{attn}{n}/kernel"].reshape(h, h) for n in ("query", "key", "value")], 1)
        out[p + "attn.c_attn.bias"] = np.concatenate(
            [weights[f"{attn}{n}/bias"].reshape(h) for n in ("query", "key", "value")])
        out[p + "attn.c_proj.weight"] = weights[attn + "attention_output/kernel"].reshape(h, h)
        out[p + "attn.c_proj.bias"] = weights[attn + "attention_output/bias"]
        for ours, theirs in (("ln_1", "self_attention_layer_norm"),
                             ("ln_2", "feedforward_layer_norm")):
            out[f"{p}{ours}.weight"] = weights[f"{k}{theirs}/gamma"]
            out[f"{p}{ours}.bias"] = weights[f"{k}{theirs}/beta"]
        for ours, theirs in (("c_fc", "feedforward_intermediate_dense"),
                             ("c_proj", "feedforward_output_dense")):
            out[f"{p}mlp.{ours}.weight"] = weights[f"{k}{theirs}/kernel"]
            out[f"{p}mlp.{ours}.bias"] = weights[f"{k}{theirs}/bias"]
    return out


def read_keras_hub(directory, raw):
    """A keras_hub>GPT2Backbone preset, read with keras-hub (its LayerNorms use 1e-5, its
    output projection is the token table)."""
    import keras_hub

    c, config_file = raw["config"], os.path.join(directory, "config.json")
    config = config_from_hf({"vocab_size": c["vocabulary_size"], "n_layer": c["num_layers"],
                             "n_head": c["num_heads"], "n_embd": c["hidden_dim"],
                             "n_inner": c["intermediate_dim"],
                             "n_positions": c["max_sequence_length"],
                             **{k: c.get("dropout", 0.1) for k in
                                ("resid_pdrop", "embd_pdrop", "attn_pdrop")}}, config_file)
    backbone = keras_hub.models.GPT2Backbone.from_preset(directory)
    weights_file = os.path.join(directory, "model.weights.h5")
    hf = keras_hub_to_hf({w.path: np.asarray(w.numpy()) for w in backbone.weights},
                         config.num_layers, config.hidden_size)
    assets = os.path.join(directory, "assets", "tokenizer")
    published = PublishedGPT2(config, hf_to_tfbig(hf, config, weights_file),
                              os.path.join(assets, "vocabulary.json"),
                              os.path.join(assets, "merges.txt"), f"keras_hub:{directory}")
    check_tokenizer(published.vocab_file, published.merges_file, config, config_file)
    return published


def write_run(output_dir, published):
    """The tfbig GPT run directory: checkpoint, vocab.json + merges.txt, config.json."""
    from tfbig.convert import run_dir

    files = {TOKENIZER["vocab_file"]: published.vocab_file,
             TOKENIZER["merges_file"]: published.merges_file}
    return run_dir.write_run(output_dir, published.config, published.weights, TOKENIZER, files,
                             published.source, "gpt")


def export(source_dir, output_dir):
    """A tfbig GPT run (converted, or trained with any strategy) -> a Hugging Face GPT-2
    directory; returns (path of model.safetensors, a note on the tokenizer)."""
    from safetensors.numpy import save_file

    from tfbig.checkpoints.checkpoint import model_variables
    from tfbig.convert.run_dir import load_model
    from tfbig.data.bpe import ByteLevelBPE
    from tfbig.data.tokenizer import for_run

    model, _ = load_model(source_dir)  # any layout tfbig-train writes (ZeRO, tensor, pipeline)
    config = model.config
    if not config.pre_layer_norm:
        raise UsageError(f"--source={source_dir}: pre_layer_norm=False (post-LN); a Hugging "
                         "Face GPT-2 is pre-LN, so this model has no GPT-2 equivalent")
    weights = {k: np.asarray(v.numpy(), np.float32) for k, v in model_variables(model).items()}
    tensors = {("" if key == HEAD[0] else "transformer.") + hf:
               np.ascontiguousarray(weights[key].T if key == HEAD[0] else weights[key])
               for key, hf in names(config).items()}
    tokenizer = for_run(source_dir)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(output_dir, "config.json"), "w") as file:
        json.dump(hf_config(config, tokenizer.eos_id), file, indent=1)
    if isinstance(tokenizer, ByteLevelBPE):
        for name, original in tokenizer.files().items():
            shutil.copyfile(original, os.path.join(output_dir, name))
        return path, "tokenizer: vocab.json + merges.txt (GPT-2's byte-level BPE)"
    shutil.copyfile(tokenizer.path, os.path.join(output_dir, "tokenizer.model"))
    return path, ("tokenizer: NOT GPT-2's. This run was trained with tfbig's SentencePiece "
                  "model, copied as tokenizer.model (load it with sentencepiece; eos_token_id="
                  f"{tokenizer.eos_id}); no vocab.json/merges.txt is written, so GPT-2 "
                  "tokenizers refuse the directory instead of producing wrong ids")
