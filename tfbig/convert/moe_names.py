"""The MoE parts of an MoE Llama's checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE): one stacked tfbig
variable per expert matrix and block (block_i/mlp/experts/gate, up: (E, C, I); down: (E, I, C)),
the router (block_i/mlp/router/kernel: (C, E)) and Qwen2-MoE's gated shared expert (block_i/
mlp/shared/gate, up, down: a bank of one; block_i/mlp/shared_gate/kernel: (C, 1)) <-> Hugging
Face's per-expert Linear weights <-> keras-hub's stacked weights. tfbig.convert.llama_names
holds the rest of the table; this module adds the MoE rows and the MoE fields of the configs.
Every tensor is checked (present, shape) before any is converted; an error names the tensor
and both shapes.

    Mixtral    model.layers.i.block_sparse_moe.gate.weight (E, C);
               ...block_sparse_moe.experts.j.w1 / w3 / w2.weight: (I, C), (I, C), (C, I);
               keras-hub MixtralBackbone: mixtral_sparse_moe_block/experts/
               expert_feedforward_{gate,intermediate,output}_dense (stacked, E first)
    Qwen3-MoE  model.layers.i.mlp.gate.weight; ...mlp.experts.j.gate_proj / up_proj /
               down_proj.weight; keras-hub Qwen3MoeBackbone: qwen3_sparse_moe_block/experts/
               expert_feedforward_gate_dense (E, C, 2I: gate then up) and
               expert_feedforward_output_dense; norm_topk_prob true is tfbig's after_topk
               router (the chosen probabilities renormalised = the softmax of the chosen
               logits), false its before_topk
    Qwen2-MoE  the Qwen3-MoE names, q/k/v biases instead of QK-norm, and one shared expert:
               ...mlp.shared_expert.gate_proj / up_proj / down_proj.weight and
               ...mlp.shared_expert_gate.weight (1, C); keras-hub QwenMoeBackbone:
               qwen_sparse_moe_block/ (experts fused as Qwen3-MoE's), shared_expert_dense/
               feedforward_{gate,intermediate,output}_dense and shared_expert_gate_dense

A tfbig MoE Llama with a shared-expert gate is a Qwen2-MoE, one with QK-norm a Qwen3-MoE, the
rest Mixtral (llama_names.model_type).
"""
import dataclasses
import re

import numpy as np

from tfbig.errors import UsageError

MATRICES = ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class MoeNames:
    model_type: str
    router: str  # Hugging Face, below model.layers.i
    expert: str  # Hugging Face, below model.layers.i: {j} the expert, {m} its matrix's name
    matrices: dict  # tfbig matrix -> Hugging Face matrix name
    keras_hub_block: str  # the MoE layer's name in a keras-hub backbone
    keras_hub_experts: dict  # tfbig matrix -> keras-hub weight below the block's experts/
    fused_gate_up: bool  # keras-hub stacks gate and up in one (E, C, 2I) weight
    shared: str = ""  # Hugging Face, below model.layers.i: the shared expert's {m} matrix
    shared_gate: str = ""  # Hugging Face, below model.layers.i: the shared expert's gate
    keras_hub_shared: str = ""  # keras-hub, below the block: the shared expert's layer
    keras_hub_shared_gate: str = ""  # keras-hub, below the block: its gate's kernel


# keras-hub's dense SwiGLU names (the shared expert of Qwen2-MoE is one), by tfbig matrix
KERAS_HUB_DENSE = {"gate": "feedforward_gate_dense", "up": "feedforward_intermediate_dense",
                   "down": "feedforward_output_dense"}
MIXTRAL = MoeNames("mixtral", "block_sparse_moe.gate.weight",
                   "block_sparse_moe.experts.{j}.{m}.weight",
                   {"gate": "w1", "up": "w3", "down": "w2"}, "mixtral_sparse_moe_block",
                   {"gate": "expert_feedforward_gate_dense",
                    "up": "expert_feedforward_intermediate_dense",
                    "down": "expert_feedforward_output_dense"}, False)
QWEN3_MOE = MoeNames("qwen3_moe", "mlp.gate.weight", "mlp.experts.{j}.{m}.weight",
                     {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
                     "qwen3_sparse_moe_block",
                     {"gate": "expert_feedforward_gate_dense",
                      "up": "expert_feedforward_gate_dense",
                      "down": "expert_feedforward_output_dense"}, True)
QWEN2_MOE = dataclasses.replace(
    QWEN3_MOE, model_type="qwen2_moe", keras_hub_block="qwen_sparse_moe_block",
    shared="mlp.shared_expert.{m}.weight", shared_gate="mlp.shared_expert_gate.weight",
    keras_hub_shared="shared_expert_dense", keras_hub_shared_gate="shared_expert_gate_dense/kernel")
BLOCKS = (MIXTRAL.keras_hub_block, QWEN3_MOE.keras_hub_block, QWEN2_MOE.keras_hub_block)


def names_of(config):
    """The checkpoint names of an MoE LlamaConfig's family."""
    if config.shared_expert_gate:
        return QWEN2_MOE
    return QWEN3_MOE if config.qk_norm else MIXTRAL


def keras_hub_path(path):
    """A keras-hub weight path with the MoE block's layer name as the first one built has it
    (keras-hub names that layer automatically: a second backbone in the process numbers it,
    mixtral_sparse_moe_block_7)."""
    return re.sub(rf"/({'|'.join(BLOCKS)})_\d+/", r"/\1/", path)


def router_row(config, block):
    """(Hugging Face name, keras-hub path) of block `block`'s router kernel."""
    names = names_of(config)
    return (f"model.layers.{block}.{names.router}",
            f"transformer_layer_{block}/{names.keras_hub_block}/sparse_feedforward_gate_dense/"
            "kernel")


def shared_gate_row(config, block):
    """(Hugging Face name, keras-hub path) of block `block`'s shared-expert gate kernel."""
    names = names_of(config)
    return (f"model.layers.{block}.{names.shared_gate}",
            f"transformer_layer_{block}/{names.keras_hub_block}/{names.keras_hub_shared_gate}")


def expert_shape(config, matrix, bank="experts"):
    """The stacked tfbig shape of `matrix` (gate, up, down) of `bank` (experts, or shared: a
    bank of one)."""
    c = config.hidden_size
    e, i = ((config.num_experts, config.moe_intermediate_size) if bank == "experts"
            else (1, config.shared_intermediate_size))
    return (e, i, c) if matrix == "down" else (e, c, i)


def rows(config):
    """[(tfbig key, [Hugging Face name of each expert], keras-hub path, matrix, bank)]: the
    routed experts' and (Qwen2-MoE) the shared expert's."""
    names = names_of(config)
    out = []
    for b in range(config.num_layers):
        block = f"transformer_layer_{b}/{names.keras_hub_block}"
        out += [(f"block_{b}/mlp/experts/{matrix}",
                 [f"model.layers.{b}." + names.expert.format(j=j, m=names.matrices[matrix])
                  for j in range(config.num_experts)],
                 f"{block}/experts/{names.keras_hub_experts[matrix]}", matrix, "experts")
                for matrix in MATRICES]
        if names.shared:
            out += [(f"block_{b}/mlp/shared/{matrix}",
                     [f"model.layers.{b}." + names.shared.format(m=names.matrices[matrix])],
                     f"{block}/{names.keras_hub_shared}/{KERAS_HUB_DENSE[matrix]}/kernel",
                     matrix, "shared") for matrix in MATRICES]
    return out


def _check(found, expected, where, name, config):
    if tuple(found) != tuple(expected):
        shared = (f", shared_intermediate_size={config.shared_intermediate_size}"
                  if config.shared_intermediate_size else "")
        raise UsageError(f"{where}: {name} has shape {tuple(found)} but the config (hidden_size="
                         f"{config.hidden_size}, intermediate_size="
                         f"{config.moe_intermediate_size}, num_experts={config.num_experts}"
                         f"{shared}) implies {tuple(expected)}")


def check_hf(tensors, config, where):
    """{tfbig expert key: (its stacked shape, [Hugging Face name of each expert])}, after every
    expert tensor of `tensors` ({Hugging Face name: anything with a shape}) is checked."""
    table = rows(config)
    missing = [name for _, names, _, _, _ in table for name in names if name not in tensors]
    if missing:
        raise UsageError(f"{where}: {len(missing)} expert tensors missing for num_experts="
                         f"{config.num_experts}, e.g. {missing[:3]}")
    for _, names, _, matrix, bank in table:
        for name in names:  # a Linear weight is (out, in): the stacked shape's last two, swapped
            _check(tensors[name].shape, expert_shape(config, matrix, bank)[:0:-1], where, name,
                   config)
    return {key: (expert_shape(config, matrix, bank), names)
            for key, names, _, matrix, bank in table}


def hf_to_tfbig(tensors, config, where):
    """{Hugging Face name: array} -> {tfbig expert key: stacked float32 array}."""
    return {key: np.stack([np.asarray(tensors[name], np.float32).T for name in names])
            for key, (_, names) in check_hf(tensors, config, where).items()}


def tfbig_to_hf(weights, config):
    """{tfbig key: array} -> {Hugging Face name: contiguous float32 array} of the experts."""
    out = {}
    for key, names, _, matrix, bank in rows(config):
        _check(weights[key].shape, expert_shape(config, matrix, bank), "the tfbig run", key,
               config)
        for j, name in enumerate(names):
            out[name] = np.ascontiguousarray(np.asarray(weights[key][j], np.float32).T)
    return out


def keras_hub_to_tfbig(weights, config, where):
    """{keras-hub weight path: array} -> {tfbig expert key: array}, shapes checked first."""
    table = rows(config)
    missing = sorted({kh for _, _, kh, _, _ in table if kh not in weights})
    if missing:
        raise UsageError(f"{where}: {len(missing)} expert weights missing, e.g. {missing[:3]}")
    fused = names_of(config).fused_gate_up
    for _, _, kh, matrix, bank in table:
        expected = expert_shape(config, matrix, bank)
        if bank == "shared":  # a plain dense SwiGLU: one kernel, not stacked
            expected = expected[1:]
        elif fused and matrix != "down":  # gate and up side by side in one weight
            expected = expected[:2] + (2 * expected[2],)
        _check(weights[kh].shape, expected, where, kh, config)
    out = {}
    for key, _, kh, matrix, bank in table:
        value = np.asarray(weights[kh], np.float32)
        if bank == "shared":
            value = value[None]
        elif fused and matrix != "down":
            half = config.moe_intermediate_size
            value = value[..., :half] if matrix == "gate" else value[..., half:]
        out[key] = value
    return out


def _no_jitter(jitter, where):
    if jitter:
        raise UsageError(f"{where}: router_jitter_noise={jitter}; tfbig's router adds no noise "
                         f"(router_jitter_noise=0)")


def _every_block_sparse(step, dense_layers, where, step_name, dense_name):
    if step != 1 or dense_layers:
        raise UsageError(f"{where}: {step_name}={step}, {dense_name}={list(dense_layers)}; "
                         f"tfbig's MoE Llama has an MoE MLP in every block ({step_name}=1, "
                         f"{dense_name}=[])")


def config_from_hf(raw, path):
    """The MoE LlamaConfig fields of a Hugging Face Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
    if raw["model_type"] in (QWEN3_MOE.model_type, QWEN2_MOE.model_type):
        _every_block_sparse(raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or [],
                            path, "decoder_sparse_step", "mlp_only_layers")
        out = {"num_experts": raw["num_experts"],
               "experts_per_token": raw["num_experts_per_tok"],
               "moe_intermediate_size": raw["moe_intermediate_size"],
               "router_softmax": ("after_topk" if raw.get("norm_topk_prob", False)
                                  else "before_topk"),
               "router_aux_loss_coef": float(raw.get("router_aux_loss_coef", 0.001))}
        if raw["model_type"] == QWEN2_MOE.model_type:  # its shared expert, gated
            out.update(shared_intermediate_size=raw["shared_expert_intermediate_size"],
                       shared_expert_gate=True)
        return out
    _no_jitter(raw.get("router_jitter_noise", 0.0), path)
    return {"num_experts": raw["num_local_experts"],
            "experts_per_token": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw["intermediate_size"],
            "router_aux_loss_coef": float(raw.get("router_aux_loss_coef", 0.02))}


def config_from_keras_hub(c, where):
    """The MoE LlamaConfig fields of a keras-hub MixtralBackbone's, QwenMoeBackbone's or
    Qwen3MoeBackbone's get_config()."""
    if "moe_intermediate_dim" in c:  # Qwen3-MoE, or Qwen2-MoE (with a shared expert)
        _every_block_sparse(c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or [],
                            where, "decoder_sparse_step", "mlp_only_layers")
        out = {"num_experts": c["num_experts"], "experts_per_token": c["top_k"],
               "moe_intermediate_size": c["moe_intermediate_dim"],
               "router_softmax": "after_topk" if c.get("norm_top_k_prob") else "before_topk",
               "router_aux_loss_coef": float(c.get("router_aux_loss_coefficient", 0.001))}
        if "shared_expert_intermediate_dim" in c:
            out.update(shared_intermediate_size=c["shared_expert_intermediate_dim"],
                       shared_expert_gate=True)
        return out
    _no_jitter(c.get("router_jitter_noise", 0.0), where)
    return {"num_experts": c["num_experts"], "experts_per_token": c["top_k"],
            "moe_intermediate_size": c["intermediate_dim"],
            "router_aux_loss_coef": float(c.get("router_aux_loss_coef", 0.02))}


def hf_config(config):
    """The MoE fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json; what the family cannot
    hold is refused by name."""
    names = names_of(config)
    holds = {"shared_intermediate_size": 0, "attention_bias": False}
    if names is MIXTRAL:
        holds["router_softmax"] = "after_topk"
    if names is QWEN2_MOE:  # q/k/v biases; heads of hidden_size / num_heads (no head_dim)
        holds = {"attention_bias": True, "head_size": config.hidden_size // config.num_heads}
    for name, value in holds.items():
        if getattr(config, name) != value:
            raise UsageError(f"{name}={getattr(config, name)!r}: a {names.model_type} checkpoint "
                             f"has {name}={value!r}; this MoE model has no Hugging Face export")
    if names is MIXTRAL:
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": config.moe_intermediate_size,
                "num_local_experts": config.num_experts,
                "num_experts_per_tok": config.experts_per_token,
                "router_aux_loss_coef": config.router_aux_loss_coef, "router_jitter_noise": 0.0,
                "output_router_logits": False, "sliding_window": None}
    out = {"architectures": ["Qwen3MoeForCausalLM" if names is QWEN3_MOE
                             else "Qwen2MoeForCausalLM"], "model_type": names.model_type,
           "moe_intermediate_size": config.moe_intermediate_size,
           "num_experts": config.num_experts, "num_experts_per_tok": config.experts_per_token,
           "norm_topk_prob": config.router_softmax == "after_topk",
           "decoder_sparse_step": 1, "mlp_only_layers": [],
           "router_aux_loss_coef": config.router_aux_loss_coef, "output_router_logits": False,
           "use_sliding_window": False, "sliding_window": None, "max_window_layers": 0}
    if names is QWEN2_MOE:  # its q/k/v biases are the architecture's, not a config field
        out["shared_expert_intermediate_size"] = config.shared_intermediate_size
    else:
        out["attention_bias"] = False
    return out
