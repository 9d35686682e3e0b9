"""The Llama family's checkpoint table and configs: tfbig keys <-> Hugging Face names <->
keras-hub weight paths, and Hugging Face / keras-hub configs <-> LlamaConfig.

One table (BLOCK, TOP) serves every direction: a row names a tfbig key, its Hugging Face name
and its keras-hub path, and the config field that must be set for the row to exist (Qwen 2's
q/k/v biases, Qwen 3's QK-norm, an untied head). Llama 2/3 (model_type "llama"), Mistral
("mistral"), Qwen 2 ("qwen2") and Qwen 3 ("qwen3") share it: keras-hub's Llama, Llama3,
Mistral, Qwen and Qwen3 backbones name their weights alike. The MoE rows (Mixtral,
"mixtral"; Qwen2-MoE, "qwen2_moe"; Qwen3-MoE, "qwen3_moe") are tfbig.convert.moe_names'.

Layouts: a Hugging Face Linear weight is (out, in), a Keras kernel (in, out): 2-D kernels are
transposed. keras-hub's EinsumDense kernels are (C, heads, hs) for q/k/v and (heads, hs, C) for
the output, biases (heads, hs): reshaped. Hugging Face's q/k weights are already in the
rotate_half (half-split) RoPE pairing that tfbig applies: no permutation.

What tfbig's Llama cannot compute is refused by name (field and value) before anything is read
or written: a sliding window shorter than the sequence, a RoPE scaling other than llama3, biases
where the family has none (Llama's attention_bias / mlp_bias), an activation other than SiLU.
"""
import numpy as np

from tfbig.convert import moe_names
from tfbig.errors import UsageError
from tfbig.models.llama_config import LlamaConfig

# (tfbig key below block_i, Hugging Face name below model.layers.i, keras-hub path below
#  transformer_layer_i, the LlamaConfig field the row needs or None)
BLOCK = [
    ("attn_norm/scale", "input_layernorm.weight", "self_attention_layernorm/scale", None),
    ("attn/query/kernel", "self_attn.q_proj.weight", "self_attention/query/kernel", None),
    ("attn/query/bias", "self_attn.q_proj.bias", "self_attention/query/bias", "attention_bias"),
    ("attn/key/kernel", "self_attn.k_proj.weight", "self_attention/key/kernel", None),
    ("attn/key/bias", "self_attn.k_proj.bias", "self_attention/key/bias", "attention_bias"),
    ("attn/value/kernel", "self_attn.v_proj.weight", "self_attention/value/kernel", None),
    ("attn/value/bias", "self_attn.v_proj.bias", "self_attention/value/bias", "attention_bias"),
    ("attn/query_norm/scale", "self_attn.q_norm.weight",
     "self_attention/query_dense_layernorm/scale", "qk_norm"),
    ("attn/key_norm/scale", "self_attn.k_norm.weight",
     "self_attention/key_dense_layernorm/scale", "qk_norm"),
    ("attn/proj/kernel", "self_attn.o_proj.weight", "self_attention/attention_output/kernel",
     None),
    ("mlp_norm/scale", "post_attention_layernorm.weight", "feedforward_layernorm/scale", None),
    ("mlp/gate/kernel", "mlp.gate_proj.weight", "feedforward_gate_dense/kernel", "dense"),
    ("mlp/up/kernel", "mlp.up_proj.weight", "feedforward_intermediate_dense/kernel", "dense"),
    ("mlp/down/kernel", "mlp.down_proj.weight", "feedforward_output_dense/kernel", "dense"),
]  # an MoE block's router and experts: tfbig.convert.moe_names
TOP = [
    ("embedding/embeddings", "model.embed_tokens.weight", "token_embedding/embeddings", None),
    ("final_norm/scale", "model.norm.weight", "sequence_output_layernorm/scale", None),
    ("head/kernel", "lm_head.weight", "token_embedding/reverse_embeddings", "untied"),
]
# Hugging Face model_type -> (architecture, the LlamaConfig fields the family implies)
FAMILIES = {"llama": ("LlamaForCausalLM", {}),
            "mistral": ("MistralForCausalLM", {}),
            "qwen2": ("Qwen2ForCausalLM", {"attention_bias": True}),
            "qwen3": ("Qwen3ForCausalLM", {"qk_norm": True}),
            "mixtral": ("MixtralForCausalLM", {}),
            "qwen2_moe": ("Qwen2MoeForCausalLM", {"attention_bias": True}),
            "qwen3_moe": ("Qwen3MoeForCausalLM", {"qk_norm": True})}
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# keras-hub backbone (its registered name, as a preset's config.json says) -> Hugging Face
# model_type of the same architecture
KERAS_HUB = {"keras_hub>LlamaBackbone": "llama", "keras_hub>Llama3Backbone": "llama",
             "keras_hub>MistralBackbone": "mistral", "keras_hub>QwenBackbone": "qwen2",
             "keras_hub>Qwen3Backbone": "qwen3", "keras_hub>MixtralBackbone": "mixtral",
             "keras_hub>QwenMoeBackbone": "qwen2_moe", "keras_hub>Qwen3MoeBackbone": "qwen3_moe"}
KERAS_HUB_SEQ_LENGTH = 2048  # a keras-hub backbone has no position limit; the converted run's


def _present(config, needs):
    special = {"untied": not config.tie_embeddings, "dense": not config.num_experts}
    return needs is None or special.get(needs, getattr(config, needs, False))


def rows(config):
    """[(tfbig key, Hugging Face name, keras-hub path)] of a model with `config`."""
    out = [(key, hf, kh) for key, hf, kh, needs in TOP if _present(config, needs)]
    for i in range(config.num_layers):
        out += [(f"block_{i}/{key}", f"model.layers.{i}.{hf}", f"transformer_layer_{i}/{kh}")
                for key, hf, kh, needs in BLOCK if _present(config, needs)]
        if config.num_experts:
            out.append((f"block_{i}/mlp/router/kernel", *moe_names.router_row(config, i)))
        if config.shared_expert_gate:
            out.append((f"block_{i}/mlp/shared_gate/kernel",
                        *moe_names.shared_gate_row(config, i)))
    return out


def shapes(config):
    """{tfbig key: shape} that `config` implies."""
    c, hs, v = config.hidden_size, config.head_size, config.vocab_size
    q, kv = config.num_heads * hs, config.num_kv_heads * hs
    by_tail = {"embedding/embeddings": (v, c), "head/kernel": (c, v),
               "attn/query/kernel": (c, q), "attn/query/bias": (q,),
               "attn/key/kernel": (c, kv), "attn/key/bias": (kv,),
               "attn/value/kernel": (c, kv), "attn/value/bias": (kv,),
               "attn/query_norm/scale": (hs,), "attn/key_norm/scale": (hs,),
               "attn/proj/kernel": (q, c), "mlp/gate/kernel": (c, config.intermediate_size),
               "mlp/up/kernel": (c, config.intermediate_size),
               "mlp/down/kernel": (config.intermediate_size, c),
               "mlp/router/kernel": (c, config.num_experts), "mlp/shared_gate/kernel": (c, 1)}
    return {key: by_tail.get(key.split("/", 1)[1] if key.startswith("block_") else key, (c,))
            for key, _, _ in rows(config)}


def keras_hub_shape(key, config):
    """The shape keras-hub stores tfbig key `key` in (EinsumDense kernels keep the heads)."""
    hs, c = config.head_size, config.hidden_size
    heads = {"query": config.num_heads, "key": config.num_kv_heads, "value": config.num_kv_heads}
    parts = key.split("/")
    if parts[-2] in heads:
        n = heads[parts[-2]]
        return (c, n, hs) if parts[-1] == "kernel" else (n, hs)
    if parts[-2] == "proj" and parts[-3] == "attn":
        return (config.num_heads, hs, c)
    return shapes(config)[key]


def hf_layout(key, value):
    """A Hugging Face tensor in tfbig's layout, or back (a 2-D kernel is transposed)."""
    return value.T if key.endswith("/kernel") else value


def _check(found, expected, where, name, config):
    if tuple(found) != tuple(expected):
        raise UsageError(f"{where}: {name} has shape {tuple(found)} but the config (hidden_size="
                         f"{config.hidden_size}, num_heads={config.num_heads}, num_kv_heads="
                         f"{config.num_kv_heads}, head_size={config.head_size}, "
                         f"intermediate_size={config.intermediate_size}, vocab_size="
                         f"{config.vocab_size}) implies {tuple(expected)}")


def check_hf(tensors, config, where):
    """Every tensor of a model with `config` in `tensors` ({Hugging Face name: anything with a
    shape}) with its shape; an error names `where`, the tensor and both shapes."""
    expected = shapes(config)
    table = rows(config)
    missing = [hf for _, hf, _ in table if hf not in tensors]
    if missing:
        raise UsageError(f"{where}: {len(missing)} tensors missing for num_layers="
                         f"{config.num_layers}, tie_word_embeddings={config.tie_embeddings}, "
                         f"e.g. {missing[:3]}")
    for key, hf, _ in table:
        shape = tuple(tensors[hf].shape)
        _check(shape, expected[key][::-1] if key.endswith("/kernel") else expected[key], where,
               hf, config)


def hf_to_tfbig(tensors, config, where):
    """{Hugging Face name: array} -> {tfbig key: float32 array}. Every tensor is checked
    (present, shape) before any is converted (check_hf)."""
    check_hf(tensors, config, where)
    table = rows(config)
    experts = moe_names.hf_to_tfbig(tensors, config, where) if config.num_experts else {}
    return {**{key: np.asarray(hf_layout(key, tensors[hf]), np.float32)
               for key, hf, _ in table}, **experts}


def tfbig_to_hf(weights, config):
    """{tfbig key: array} -> {Hugging Face name: contiguous float32 array}; shapes checked."""
    expected = shapes(config)
    for key, _, _ in rows(config):
        _check(weights[key].shape, expected[key], "the tfbig run", key, config)
    experts = moe_names.tfbig_to_hf(weights, config) if config.num_experts else {}
    return {**{hf: np.ascontiguousarray(hf_layout(key, np.asarray(weights[key], np.float32)))
               for key, hf, _ in rows(config)}, **experts}


def keras_hub_to_tfbig(weights, config, where):
    """{keras-hub weight path: array} -> {tfbig key: array}, every shape checked first."""
    table = rows(config)
    missing = [kh for _, _, kh in table if kh not in weights]
    if missing:
        raise UsageError(f"{where}: {len(missing)} weights missing, e.g. {missing[:3]}")
    for key, _, kh in table:
        _check(weights[kh].shape, keras_hub_shape(key, config), where, kh, config)
    expected = shapes(config)
    experts = moe_names.keras_hub_to_tfbig(weights, config, where) if config.num_experts else {}
    return {**{key: np.asarray(weights[kh], np.float32).reshape(expected[key])
               for key, _, kh in table}, **experts}


def _rope_from_hf(raw, path):
    """The LlamaConfig RoPE fields of a Hugging Face config (rope_scaling, or transformers 5's
    rope_parameters)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "llama3":
        raise UsageError(f"{path}: rope_scaling.rope_type={kind!r}; tfbig's Llama computes "
                         "RoPE without scaling (default) or with Llama 3's (llama3)")
    return {"rope_theta": float(theta), "rope_scaling": "llama3",
            "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_seq_length": int(scaling["original_max_position_embeddings"])}


def _refuse_hf_features(raw, model_type, seq_length, path):
    if raw.get("hidden_act", "silu") != "silu":
        raise UsageError(f"{path}: hidden_act={raw['hidden_act']!r}; tfbig's Llama computes "
                         "SwiGLU with SiLU (hidden_act='silu')")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UsageError(f"{path}: {key}={raw[key]}; a {model_type} in tfbig has no "
                             f"{'output/' if key == 'attention_bias' else 'MLP '}biases "
                             f"({key}=false)")
    window = raw.get("sliding_window")
    active = raw.get("use_sliding_window", model_type in ("mistral", "mixtral"))
    if active and window is not None and window < seq_length:
        raise UsageError(f"{path}: sliding_window={window} with max_position_embeddings="
                         f"{seq_length}; tfbig's Llama attends over the whole sequence "
                         "(sliding_window null, or at least max_position_embeddings)")


def config_from_hf(raw, path):
    """LlamaConfig from a Hugging Face config.json dict; refusals name the field and value."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise UsageError(f"{path}: model_type={model_type!r}; the Llama family reads "
                         f"{sorted(FAMILIES)}")
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")
    missing = [k for k in keys if k not in raw]
    if missing:
        raise UsageError(f"{path}: missing {missing}; expected a {FAMILIES[model_type][0]} "
                         "config")
    seq_length = raw.get("max_position_embeddings", 2048)
    _refuse_hf_features(raw, model_type, seq_length, path)
    heads = raw["num_attention_heads"]
    try:
        return LlamaConfig(
            vocab_size=raw["vocab_size"], seq_length=seq_length,
            num_layers=raw["num_hidden_layers"], hidden_size=raw["hidden_size"],
            num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_size=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            rms_norm_epsilon=raw.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dropout=float(raw.get("attention_dropout", 0.0)),
            initializer_range=raw.get("initializer_range", 0.02),
            **_rope_from_hf(raw, path), **FAMILIES[model_type][1],
            **(moe_names.config_from_hf(raw, path) if model_type in MOE_TYPES else {}))
    except ValueError as error:
        raise UsageError(f"{path}: {error}") from error


def model_type(config):
    """The Hugging Face model_type a tfbig Llama exports as."""
    if config.attention_bias and config.qk_norm:
        raise UsageError("attention_bias=True with qk_norm=True: no Hugging Face family has "
                         "both (Qwen 2 has the biases, Qwen 3 the QK-norm)")
    if config.num_experts:
        return moe_names.names_of(config).model_type
    return "qwen2" if config.attention_bias else "qwen3" if config.qk_norm else "llama"


def hf_config(config, bos_id=None, eos_id=None):
    """The Hugging Face config.json of a tfbig Llama (LlamaForCausalLM, or Qwen2/Qwen3)."""
    kind = model_type(config)
    rope = None if config.rope_scaling == "none" else {
        "rope_type": "llama3", "factor": config.rope_factor,
        "low_freq_factor": config.rope_low_freq_factor,
        "high_freq_factor": config.rope_high_freq_factor,
        "original_max_position_embeddings": config.rope_original_seq_length}
    out = {"architectures": [FAMILIES[kind][0]], "model_type": kind,
           "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
           "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
           "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_size,
           "hidden_act": "silu", "max_position_embeddings": config.seq_length,
           "rms_norm_eps": config.rms_norm_epsilon, "rope_theta": config.rope_theta,
           "rope_scaling": rope, "tie_word_embeddings": config.tie_embeddings,
           "attention_dropout": config.dropout, "initializer_range": config.initializer_range,
           "torch_dtype": "float32", "bos_token_id": bos_id, "eos_token_id": eos_id}
    if kind in MOE_TYPES:
        out.update(moe_names.hf_config(config))
    elif kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
        if kind == "qwen3":
            out["attention_bias"] = False
    return out


def config_from_keras_hub(backbone, where):
    """LlamaConfig of a keras-hub Llama/Llama3/Mistral/Qwen/Qwen3 backbone object."""
    import keras

    name = keras.saving.get_registered_name(backbone.__class__)
    if name not in KERAS_HUB:
        raise UsageError(f"{where}: a {name}; the Llama family reads {sorted(KERAS_HUB)}")
    c = backbone.get_config()
    for key in ("rope_position_scaling_factor", "rope_scaling_factor"):
        if c.get(key, 1.0) != 1.0:
            raise UsageError(f"{where}: {key}={c[key]}; tfbig's Llama scales RoPE only the "
                             "Llama 3 way (rope_frequency_adjustment_factor, ...)")
    seq_length = KERAS_HUB_SEQ_LENGTH
    window = c.get("sliding_window", c.get("sliding_window_size"))
    active = c.get("use_sliding_window_attention", name != "keras_hub>QwenBackbone")
    if active and window and window < seq_length:
        raise UsageError(f"{where}: sliding_window={window}, below the converted model's "
                         f"seq_length={seq_length}; tfbig's Llama attends over the whole "
                         "sequence (build the backbone with sliding_window=None)")
    rope = {"rope_theta": float(c.get("rope_max_wavelength", 10000))}
    if c.get("rope_frequency_adjustment_factor") is not None:
        rope.update(rope_scaling="llama3", rope_factor=c["rope_frequency_adjustment_factor"],
                    rope_low_freq_factor=c["rope_low_freq_factor"],
                    rope_high_freq_factor=c["rope_high_freq_factor"],
                    rope_original_seq_length=c["rope_pretraining_sequence_length"])
    heads = c["num_query_heads"]
    return LlamaConfig(
        vocab_size=c["vocabulary_size"], seq_length=seq_length, num_layers=c["num_layers"],
        hidden_size=c["hidden_dim"], num_heads=heads, num_kv_heads=c["num_key_value_heads"],
        head_size=c.get("head_dim") or c["hidden_dim"] // heads,
        intermediate_size=c["intermediate_dim"], rms_norm_epsilon=c["layer_norm_epsilon"],
        tie_embeddings=bool(getattr(backbone, "tie_word_embeddings", False)),
        dropout=float(c.get("dropout", 0.0)), **rope,
        **FAMILIES[KERAS_HUB[name]][1],
        **(moe_names.config_from_keras_hub(c, where) if "num_experts" in c else {}))
