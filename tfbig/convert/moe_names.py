"""The expert weights of an MoE Llama (Mixtral) in checkpoints: one stacked tfbig variable per
matrix and block (block_i/mlp/experts/gate, up: (E, C, I); down: (E, I, C), keras-hub
Mixtral's layout) <-> Hugging Face's per-expert Linear weights
(model.layers.i.block_sparse_moe.experts.j.w1 / w3 / w2.weight: (I, C), (I, C), (C, I)) <->
keras-hub MixtralBackbone's stacked weights. The router is a row of tfbig.convert.llama_names'
table (block_sparse_moe.gate.weight); this module adds the stacked rows and the MoE fields of
the configs. Every tensor is checked (present, shape) before any is converted; an error names
the tensor and both shapes.
"""
import re

import numpy as np

from tfbig.errors import UsageError

# (tfbig matrix, Hugging Face name, keras-hub weight below mixtral_sparse_moe_block/experts/)
EXPERTS = [("gate", "w1", "expert_feedforward_gate_dense"),
           ("up", "w3", "expert_feedforward_intermediate_dense"),
           ("down", "w2", "expert_feedforward_output_dense")]
KERAS_HUB_BLOCK = "mixtral_sparse_moe_block"


def keras_hub_path(path):
    """A keras-hub weight path with the MoE block's layer name as the first one built has it
    (keras-hub names that layer automatically: a second backbone in the process numbers it,
    mixtral_sparse_moe_block_7)."""
    return re.sub(rf"/{KERAS_HUB_BLOCK}_\d+/", f"/{KERAS_HUB_BLOCK}/", path)


def expert_shape(config, matrix):
    """The stacked tfbig shape of `matrix` (gate, up, down)."""
    c, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    return (e, i, c) if matrix == "down" else (e, c, i)


def rows(config):
    """[(tfbig key, [Hugging Face name of each expert], keras-hub path, matrix)]."""
    return [(f"block_{b}/mlp/experts/{matrix}",
             [f"model.layers.{b}.block_sparse_moe.experts.{j}.{hf}.weight"
              for j in range(config.num_experts)],
             f"transformer_layer_{b}/{KERAS_HUB_BLOCK}/experts/{kh}", matrix)
            for b in range(config.num_layers) for matrix, hf, kh in EXPERTS]


def _check(found, expected, where, name, config):
    if tuple(found) != tuple(expected):
        raise UsageError(f"{where}: {name} has shape {tuple(found)} but the config (hidden_size="
                         f"{config.hidden_size}, intermediate_size="
                         f"{config.moe_intermediate_size}, num_experts={config.num_experts}) "
                         f"implies {tuple(expected)}")


def hf_to_tfbig(tensors, config, where):
    """{Hugging Face name: array} -> {tfbig expert key: stacked float32 array}."""
    table = rows(config)
    missing = [name for _, names, _, _ in table for name in names if name not in tensors]
    if missing:
        raise UsageError(f"{where}: {len(missing)} expert tensors missing for num_experts="
                         f"{config.num_experts}, e.g. {missing[:3]}")
    for _, names, _, matrix in table:
        for name in names:  # a Linear weight is (out, in): the stacked shape's last two, swapped
            _check(tensors[name].shape, expert_shape(config, matrix)[:0:-1], where, name, config)
    return {key: np.stack([np.asarray(tensors[name], np.float32).T for name in names])
            for key, names, _, _ in table}


def tfbig_to_hf(weights, config):
    """{tfbig key: array} -> {Hugging Face name: contiguous float32 array} of the experts."""
    out = {}
    for key, names, _, matrix in rows(config):
        _check(weights[key].shape, expert_shape(config, matrix), "the tfbig run", key, config)
        for j, name in enumerate(names):
            out[name] = np.ascontiguousarray(np.asarray(weights[key][j], np.float32).T)
    return out


def keras_hub_to_tfbig(weights, config, where):
    """{keras-hub weight path: array} -> {tfbig expert key: array}, shapes checked first."""
    table = rows(config)
    missing = [kh for _, _, kh, _ in table if kh not in weights]
    if missing:
        raise UsageError(f"{where}: {len(missing)} expert weights missing, e.g. {missing[:3]}")
    for _, _, kh, matrix in table:
        _check(weights[kh].shape, expert_shape(config, matrix), where, kh, config)
    return {key: np.asarray(weights[kh], np.float32) for key, _, kh, _ in table}


def config_from_hf(raw, path):
    """The MoE LlamaConfig fields of a Hugging Face Mixtral config.json."""
    if raw.get("router_jitter_noise", 0.0):
        raise UsageError(f"{path}: router_jitter_noise={raw['router_jitter_noise']}; tfbig's "
                         f"router adds no noise (router_jitter_noise=0)")
    return {"num_experts": raw["num_local_experts"],
            "experts_per_token": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw["intermediate_size"],
            "router_aux_loss_coef": float(raw.get("router_aux_loss_coef", 0.02))}


def config_from_keras_hub(c, where):
    """The MoE LlamaConfig fields of a keras-hub MixtralBackbone's get_config()."""
    if c.get("router_jitter_noise", 0.0):
        raise UsageError(f"{where}: router_jitter_noise={c['router_jitter_noise']}; tfbig's "
                         f"router adds no noise (router_jitter_noise=0)")
    return {"num_experts": c["num_experts"], "experts_per_token": c["top_k"],
            "moe_intermediate_size": c["intermediate_dim"],
            "router_aux_loss_coef": float(c.get("router_aux_loss_coef", 0.02))}


def hf_config(config):
    """The MoE fields of a Mixtral config.json; what Mixtral cannot hold is refused by name."""
    for name, value, mixtral in (("shared_intermediate_size", config.shared_intermediate_size,
                                  0), ("router_softmax", config.router_softmax, "after_topk"),
                                 ("attention_bias", config.attention_bias, False),
                                 ("qk_norm", config.qk_norm, False)):
        if value != mixtral:
            raise UsageError(f"{name}={value!r}: a Mixtral checkpoint has {name}={mixtral!r}; "
                             f"this MoE model has no Hugging Face export")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": config.moe_intermediate_size,
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.experts_per_token,
            "router_aux_loss_coef": config.router_aux_loss_coef, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}
