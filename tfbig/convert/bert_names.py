"""BERT weights under three outside naming schemes, mapped to and from tfbig's keys.

The pivot is the original Google TF1 layout (`bert/encoder/layer_0/attention/self/query/kernel`,
kernels stored (in, out)): Hugging Face names are the same path with dots and PyTorch's (out, in)
`weight`; keras-hub splits attention kernels per head. tfbig fuses query, key and value into one
(H, 3H) `attn/qkv` kernel whose columns are [q | k | v], each head-major, as the three kernels
side by side are.

Example:
    google = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    weights = google_to_tfbig(google, config)   # {"backbone/block_0/attn/qkv/kernel": ...}
"""
import numpy as np

# tfbig key below a block -> Google key below bert/encoder/layer_i
BLOCK = {"attn/proj/kernel": "attention/output/dense/kernel",
         "attn/proj/bias": "attention/output/dense/bias",
         "attn_norm/gamma": "attention/output/LayerNorm/gamma",
         "attn_norm/beta": "attention/output/LayerNorm/beta",
         "ffn/fc/kernel": "intermediate/dense/kernel", "ffn/fc/bias": "intermediate/dense/bias",
         "ffn/proj/kernel": "output/dense/kernel", "ffn/proj/bias": "output/dense/bias",
         "ffn_norm/gamma": "output/LayerNorm/gamma", "ffn_norm/beta": "output/LayerNorm/beta"}
QKV = ("query", "key", "value")
# tfbig key -> Google key, outside the blocks
BACKBONE = {"backbone/embedding/word/embeddings": "bert/embeddings/word_embeddings",
            "backbone/embedding/position/embeddings": "bert/embeddings/position_embeddings",
            "backbone/embedding/segment/embeddings": "bert/embeddings/token_type_embeddings",
            "backbone/embedding/norm/gamma": "bert/embeddings/LayerNorm/gamma",
            "backbone/embedding/norm/beta": "bert/embeddings/LayerNorm/beta",
            "backbone/pooler/kernel": "bert/pooler/dense/kernel",
            "backbone/pooler/bias": "bert/pooler/dense/bias"}
PRETRAINING = {"mlm_head/dense/kernel": "cls/predictions/transform/dense/kernel",
               "mlm_head/dense/bias": "cls/predictions/transform/dense/bias",
               "mlm_head/norm/gamma": "cls/predictions/transform/LayerNorm/gamma",
               "mlm_head/norm/beta": "cls/predictions/transform/LayerNorm/beta",
               "mlm_head/bias": "cls/predictions/output_bias",
               "nsp_head/kernel": "cls/seq_relationship/output_weights",  # stored (2, H)
               "nsp_head/bias": "cls/seq_relationship/output_bias"}


def google_names(num_layers, pretraining=True):
    """Every Google TF1 variable name of a BERT with `num_layers` layers."""
    names = list(BACKBONE.values())
    for i in range(num_layers):
        layer = f"bert/encoder/layer_{i}/"
        names += [layer + n for n in BLOCK.values()]
        names += [f"{layer}attention/self/{p}/{kind}" for p in QKV for kind in ("kernel", "bias")]
    return names + (list(PRETRAINING.values()) if pretraining else [])


def google_to_tfbig(google, num_layers):
    """{Google name: array} -> {tfbig key: array}; pretraining heads only if all are present."""
    out = {key: google[name] for key, name in BACKBONE.items()}
    for i in range(num_layers):
        layer, block = f"bert/encoder/layer_{i}/", f"backbone/block_{i}/"
        out.update({block + key: google[layer + name] for key, name in BLOCK.items()})
        for kind in ("kernel", "bias"):
            parts = [google[f"{layer}attention/self/{p}/{kind}"] for p in QKV]
            out[f"{block}attn/qkv/{kind}"] = np.concatenate(parts, axis=-1)  # (H, 3H) / (3H,)
    if all(name in google for name in PRETRAINING.values()):
        out.update({key: google[name] for key, name in PRETRAINING.items()})
        out["nsp_head/kernel"] = out["nsp_head/kernel"].T  # (H, 2)
    return out


def tfbig_to_google(weights, num_layers):
    """The inverse of google_to_tfbig (heads only if `weights` has them)."""
    out = {name: weights[key] for key, name in BACKBONE.items()}
    for i in range(num_layers):
        layer, block = f"bert/encoder/layer_{i}/", f"backbone/block_{i}/"
        out.update({layer + name: weights[block + key] for key, name in BLOCK.items()})
        for kind in ("kernel", "bias"):
            parts = np.split(weights[f"{block}attn/qkv/{kind}"], 3, axis=-1)
            out.update({f"{layer}attention/self/{p}/{kind}": x for p, x in zip(QKV, parts)})
    if "mlm_head/bias" in weights:
        out.update({name: weights[key] for key, name in PRETRAINING.items()})
        out["cls/seq_relationship/output_weights"] = weights["nsp_head/kernel"].T
    return out


def hf_name(google_name):
    """Hugging Face name of a Google TF1 name (BertForPreTraining layout, LayerNorm weight/bias)
    and whether the tensor is transposed between the two."""
    name = google_name.replace("/", ".")
    transposed = name.endswith(".kernel")
    for old, new in ((".kernel", ".weight"), (".gamma", ".weight"), (".beta", ".bias"),
                     ("_embeddings", "_embeddings.weight"), ("layer_", "layer."),
                     ("cls.predictions.output_bias", "cls.predictions.bias"),
                     ("seq_relationship.output_weights", "seq_relationship.weight"),
                     ("seq_relationship.output_bias", "seq_relationship.bias")):
        name = name.replace(old, new)
    return name, transposed


def hf_to_google(tensors, num_layers):
    """{Hugging Face name: array} -> {Google name: array}, for names of BertModel (no "bert."
    prefix) or BertForPreTraining, LayerNorm as weight/bias or gamma/beta."""
    prefix = "bert." if any(n.startswith("bert.") for n in tensors) else ""
    out = {}
    for google in google_names(num_layers):
        name, transposed = hf_name(google)
        if name.startswith("bert."):
            name = prefix + name[len("bert."):]
        candidates = [name, name.replace("LayerNorm.weight", "LayerNorm.gamma")
                      .replace("LayerNorm.bias", "LayerNorm.beta")]
        found = next((n for n in candidates if n in tensors), None)
        if found is not None:
            out[google] = tensors[found].T if transposed else tensors[found]
    return out


def google_to_hf(google):
    """{Google name: array} -> {Hugging Face name: array} (BertForPreTraining layout, with the
    tied decoder weight HF's loader expects left to the tie)."""
    out = {}
    for google_name, value in google.items():
        name, transposed = hf_name(google_name)
        out[name] = np.ascontiguousarray(value.T if transposed else value)
    return out


def keras_hub_to_google(weights, num_layers, hidden_size):
    """{keras-hub BertBackbone weight path: array} -> {Google name: array} (backbone only)."""
    h = hidden_size
    out = {"bert/embeddings/word_embeddings": weights["token_embedding/embeddings"],
           "bert/embeddings/position_embeddings": weights["position_embedding/embeddings"],
           "bert/embeddings/token_type_embeddings": weights["segment_embedding/embeddings"],
           "bert/embeddings/LayerNorm/gamma": weights["embeddings_layer_norm/gamma"],
           "bert/embeddings/LayerNorm/beta": weights["embeddings_layer_norm/beta"],
           "bert/pooler/dense/kernel": weights["pooled_dense/kernel"],
           "bert/pooler/dense/bias": weights["pooled_dense/bias"]}
    parts = {"attention/output/dense": "self_attention_layer/attention_output",
             "attention/output/LayerNorm": "self_attention_layer_norm",
             "intermediate/dense": "feedforward_intermediate_dense",
             "output/dense": "feedforward_output_dense",
             "output/LayerNorm": "feedforward_layer_norm",
             **{f"attention/self/{p}": f"self_attention_layer/{p}" for p in QKV}}
    for i in range(num_layers):
        for google, ours in parts.items():
            for kind in ("kernel", "bias", "gamma", "beta"):
                path = f"transformer_layer_{i}/{ours}/{kind}"
                if path in weights:  # per-head (H, nh, hs) / (nh, hs, H) / (nh, hs) flattened
                    value = weights[path]
                    if kind != "kernel":
                        value = value.reshape(-1)
                    elif value.ndim == 3:
                        value = value.reshape(h, h)
                    out[f"bert/encoder/layer_{i}/{google}/{kind}"] = value
    return out


def google_shapes(config):
    """{Google TF1 name: shape} that `config` implies (pretraining heads included)."""
    v, h, i = config.vocab_size, config.hidden_size, config.intermediate_size
    shapes = {"bert/embeddings/word_embeddings": (v, h),
              "bert/embeddings/position_embeddings": (config.seq_length, h),
              "bert/embeddings/token_type_embeddings": (config.type_vocab_size, h),
              "bert/pooler/dense/kernel": (h, h), "cls/predictions/transform/dense/kernel": (h, h),
              "cls/predictions/output_bias": (v,), "cls/seq_relationship/output_weights": (2, h),
              "cls/seq_relationship/output_bias": (2,)}
    kernels = {"intermediate/dense/kernel": (h, i), "intermediate/dense/bias": (i,),
               "output/dense/kernel": (i, h)}
    for name in google_names(config.num_layers):
        if name not in shapes:
            tail = name.split("/", 3)[-1] if name.startswith("bert/encoder/") else ""
            shapes[name] = kernels.get(tail, (h, h) if name.endswith("kernel") else (h,))
    return shapes
