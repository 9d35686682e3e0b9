"""ALBERT weights under the Google TF1 and Hugging Face names, and the readers of published
ALBERT directories (Hugging Face, Google TF1 `model.ckpt`, keras-hub presets).

One table lists every tensor as (tfbig key, Google TF1 name, Hugging Face name); Google kernels
are (in, out), Hugging Face weights (out, in); tfbig fuses query/key/value into `attn/qkv` as
for BERT (tfbig.convert.bert_names). tfbig's ALBERT runs one layer per group call
(`inner_group_num` 1, as every released ALBERT); other values are refused.
"""
import os

import numpy as np

from tfbig.convert.bert_names import QKV
from tfbig.errors import UsageError
from tfbig.models.configs import AlbertConfig

# tfbig key below group_g, Google name below .../group_g/inner_group_0/, HF name below
# albert.encoder.albert_layer_groups.g.albert_layers.0.
BLOCK = [("attn/proj/{}", "attention_1/output/dense/{}", "attention.dense.{}"),
         ("attn_norm/{}", "LayerNorm/{}", "attention.LayerNorm.{}"),
         ("ffn/fc/{}", "ffn_1/intermediate/dense/{}", "ffn.{}"),
         ("ffn/proj/{}", "ffn_1/intermediate/output/dense/{}", "ffn_output.{}"),
         ("ffn_norm/{}", "LayerNorm_1/{}", "full_layer_layer_norm.{}")]
OUTSIDE = [("backbone/embedding/word/embeddings", "bert/embeddings/word_embeddings",
            "albert.embeddings.word_embeddings.weight"),
           ("backbone/embedding/position/embeddings", "bert/embeddings/position_embeddings",
            "albert.embeddings.position_embeddings.weight"),
           ("backbone/embedding/segment/embeddings", "bert/embeddings/token_type_embeddings",
            "albert.embeddings.token_type_embeddings.weight"),
           ("backbone/embedding/norm/{}", "bert/embeddings/LayerNorm/{}",
            "albert.embeddings.LayerNorm.{}"),
           ("backbone/projection/{}", "bert/encoder/embedding_hidden_mapping_in/{}",
            "albert.encoder.embedding_hidden_mapping_in.{}"),
           ("backbone/pooler/{}", "bert/pooler/dense/{}", "albert.pooler.{}")]
HEADS = [("mlm_head/dense/{}", "cls/predictions/transform/dense/{}", "predictions.dense.{}"),
         ("mlm_head/norm/{}", "cls/predictions/transform/LayerNorm/{}",
          "predictions.LayerNorm.{}"),
         ("mlm_head/bias", "cls/predictions/output_bias", "predictions.bias"),
         ("sop_head/kernel", "cls/seq_relationship/output_weights",
          "sop_classifier.classifier.weight"),
         ("sop_head/bias", "cls/seq_relationship/output_bias", "sop_classifier.classifier.bias")]


def _expand(rows):
    """Rows with a {} placeholder become kernel/bias (Dense) or gamma/beta (LayerNorm) rows; the
    Hugging Face names say weight/bias for both."""
    out = []
    for tfbig, google, hf in rows:
        if "{}" not in tfbig:
            out.append((tfbig, google, hf))
            continue
        kinds = (("gamma", "weight"), ("beta", "bias")) if "norm" in tfbig.lower() else \
            (("kernel", "weight"), ("bias", "bias"))
        out += [(tfbig.format(k), google.format(k), hf.format(h)) for k, h in kinds]
    return out


def table(num_groups):
    """[(tfbig key, Google name, HF name)] of every tensor but the fused query/key/value."""
    rows = _expand(OUTSIDE)
    for g in range(num_groups):
        google = f"bert/encoder/transformer/group_{g}/inner_group_0/"
        hf = f"albert.encoder.albert_layer_groups.{g}.albert_layers.0."
        rows += [(f"backbone/group_{g}/{t}", google + n, hf + h) for t, n, h in _expand(BLOCK)]
    return rows + _expand(HEADS)


def qkv_table(num_groups):
    """[(tfbig qkv key, [Google q, k, v names], [HF q, k, v names])]."""
    rows = []
    for g in range(num_groups):
        google = f"bert/encoder/transformer/group_{g}/inner_group_0/attention_1/self/"
        hf = f"albert.encoder.albert_layer_groups.{g}.albert_layers.0.attention."
        rows += [(f"backbone/group_{g}/attn/qkv/{kind}",
                  [f"{google}{p}/{kind}" for p in QKV],
                  [f"{hf}{p}.{'weight' if kind == 'kernel' else 'bias'}" for p in QKV])
                 for kind in ("kernel", "bias")]
    return rows


def _tfbig_transposed(tfbig_key):
    return tfbig_key == "sop_head/kernel"  # Google and HF store it (2, H)


def google_to_tfbig(google, num_groups):
    """{Google name: array} -> {tfbig key: array}; heads only if all are present."""
    out = {}
    for tfbig, name, _ in table(num_groups):
        if name in google:
            out[tfbig] = google[name].T if _tfbig_transposed(tfbig) else google[name]
    for tfbig, names, _ in qkv_table(num_groups):
        out[tfbig] = np.concatenate([google[n] for n in names], axis=-1)
    if not all(t in out for t, _, _ in _expand(HEADS)):
        out = {k: v for k, v in out.items() if k.startswith("backbone/")}
    return out


def hf_to_google(tensors, num_groups):
    """{HF name: array} -> {Google name: array} (AlbertModel or AlbertForPreTraining names)."""
    prefix = "" if any(n.startswith("albert.") for n in tensors) else "albert."
    out = {}
    rows = table(num_groups) + [(None, g, h) for _, gs, hs in qkv_table(num_groups)
                                for g, h in zip(gs, hs)]
    for _, google, hf in rows:
        name = hf[len(prefix):] if prefix and hf.startswith(prefix) else hf
        if name in tensors:
            value = tensors[name]
            out[google] = value.T if google.endswith("/kernel") else value
    return out


def google_shapes(config):
    """{Google name: shape} that an AlbertConfig implies."""
    v, e, h, i = config.vocab_size, config.embedding_size, config.hidden_size, \
        config.intermediate_size
    special = {"seq_relationship/output_bias": (2,), "word_embeddings": (v, e),
               "position_embeddings": (config.seq_length, e),
               "token_type_embeddings": (config.type_vocab_size, e),
               "embedding_hidden_mapping_in/kernel": (e, h), "embedding_hidden_mapping_in/bias":
               (h,), "embeddings/LayerNorm": (e,), "ffn_1/intermediate/dense/kernel": (h, i),
               "ffn_1/intermediate/dense/bias": (i,), "intermediate/output/dense/kernel": (i, h),
               "transform/dense/kernel": (h, e), "transform/dense/bias": (e,),
               "transform/LayerNorm": (e,), "output_bias": (v,), "output_weights": (2, h)}
    shapes = {}
    names = [g for _, g, _ in table(config.num_groups)] + \
        [g for _, gs, _ in qkv_table(config.num_groups) for g in gs]
    for name in names:
        match = [shape for key, shape in special.items() if key in name]
        shapes[name] = match[0] if match else (h, h) if name.endswith("kernel") else (h,)
    return shapes


def config_from_json(raw, path):
    """AlbertConfig from a Hugging Face config.json or a Google albert_config.json."""
    keys = ("vocab_size", "embedding_size", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "intermediate_size", "max_position_embeddings")
    missing = [k for k in keys if k not in raw]
    if missing:
        raise UsageError(f"{path}: missing {missing}; expected an ALBERT config")
    if raw.get("inner_group_num", 1) != 1:
        raise UsageError(f"{path}: inner_group_num={raw['inner_group_num']}; tfbig's ALBERT "
                         "runs one layer per group (inner_group_num 1, as the released models)")
    act = raw.get("hidden_act", "gelu_new")
    if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh") or (
            act == "gelu" and "model_type" in raw):
        raise UsageError(f"{path}: hidden_act={act!r}; tfbig's ALBERT computes the tanh GELU "
                         "(gelu_new)")
    return AlbertConfig(
        vocab_size=raw["vocab_size"], embedding_size=raw["embedding_size"],
        hidden_size=raw["hidden_size"], num_layers=raw["num_hidden_layers"],
        num_groups=raw.get("num_hidden_groups", 1), num_heads=raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"], seq_length=raw["max_position_embeddings"],
        type_vocab_size=raw.get("type_vocab_size", 2),
        dropout=raw.get("hidden_dropout_prob", 0.0),
        layer_norm_epsilon=raw.get("layer_norm_eps", 1e-12),
        initializer_range=raw.get("initializer_range", 0.02))


def keras_hub_to_google(weights, num_groups, hidden_size):
    """{keras-hub AlbertBackbone weight path: array} -> {Google name: array}."""
    from tfbig.convert.bert_names import keras_hub_to_google as bert_layout

    renamed = {}
    for path, value in weights.items():
        for g in range(num_groups):  # group g's one inner layer, in BERT's layer naming
            path = path.replace(f"group_{g}_inner_layer_0/", f"transformer_layer_{g}/")
        renamed[path] = value
    bert = bert_layout(renamed, num_groups, hidden_size)
    out = {"bert/encoder/embedding_hidden_mapping_in/kernel":
           weights["embedding_projection/kernel"],
           "bert/encoder/embedding_hidden_mapping_in/bias": weights["embedding_projection/bias"]}
    moves = {"attention/self/": "attention_1/self/", "attention/output/dense/":
             "attention_1/output/dense/", "attention/output/LayerNorm/": "LayerNorm/",
             "intermediate/dense/": "ffn_1/intermediate/dense/",
             "output/dense/": "ffn_1/intermediate/output/dense/",
             "output/LayerNorm/": "LayerNorm_1/"}
    for name, value in bert.items():
        if name.startswith("bert/encoder/layer_"):
            layer, rest = name[len("bert/encoder/layer_"):].split("/", 1)
            for old, new in moves.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            name = f"bert/encoder/transformer/group_{layer}/inner_group_0/{rest}"
        out[name] = value
    return out


def check_tokenizer(path, config, config_file):
    """The SentencePiece model exists and has config.vocab_size pieces."""
    import sentencepiece as spm

    if not os.path.isfile(path):
        raise UsageError(f"{path}: file not found (the ALBERT SentencePiece model)")
    size = spm.SentencePieceProcessor(model_file=path).get_piece_size()
    if size != config.vocab_size:
        raise UsageError(f"{path}: {size} pieces, but {config_file} says vocab_size="
                         f"{config.vocab_size}; they must come from the same model")


def tfbig_to_google(weights, num_groups):
    """The inverse of google_to_tfbig (heads only if `weights` has them)."""
    out = {}
    for tfbig, name, _ in table(num_groups):
        if tfbig in weights:
            out[name] = weights[tfbig].T if _tfbig_transposed(tfbig) else weights[tfbig]
    for tfbig, names, _ in qkv_table(num_groups):
        out.update(zip(names, np.split(weights[tfbig], 3, axis=-1)))
    return out


def google_to_hf(google, num_groups):
    """{Google name: array} -> {HF name: array} (AlbertForPreTraining names)."""
    rows = table(num_groups) + [(None, g, h) for _, gs, hs in qkv_table(num_groups)
                                for g, h in zip(gs, hs)]
    return {hf: np.ascontiguousarray(google[g].T if g.endswith("/kernel") else google[g])
            for _, g, hf in rows if g in google}


def hf_config(config, pretraining):
    """A Hugging Face config.json dict for an AlbertConfig."""
    return {"architectures": ["AlbertForPreTraining" if pretraining else "AlbertModel"],
            "model_type": "albert", "vocab_size": config.vocab_size,
            "embedding_size": config.embedding_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers, "num_hidden_groups": config.num_groups,
            "inner_group_num": 1, "num_attention_heads": config.num_heads,
            "intermediate_size": config.intermediate_size, "hidden_act": "gelu_new",
            "hidden_dropout_prob": config.dropout, "attention_probs_dropout_prob": config.dropout,
            "max_position_embeddings": config.seq_length,
            "type_vocab_size": config.type_vocab_size,
            "initializer_range": config.initializer_range,
            "layer_norm_eps": config.layer_norm_epsilon, "pad_token_id": 0}
