"""`tfbig-plan`: memory, speed and time-to-train of a model on a cluster, and the layout to use.

Model and layout flags carry tfbig-train's names; each layout flag given fixes that part of the
layout, the rest is searched. TensorFlow is never imported, so the answer comes in well under a
second.

Example:
    tfbig-plan --preset=175b --gpu=A100-40GB --gpus_per_node=8 --nodes=120 --seq_length=2048
    tfbig-plan --preset=13b --nodes=2 --tensor_parallel=8 --zero_stage=1 --json
"""
import sys

from absl import flags

from tfbig.commands import cli
from tfbig.models import shapes as models
from tfbig.plan import calibration as calibration_lib
from tfbig.plan import hardware, report, search

# flag -> (definer name, default, help); layout flags are searched unless given.
FLAGS_SPEC = {
    "model": ("string", "gpt", "Model family: gpt | albert | llama."),
    "preset": ("string", "small", "Model size preset (tfbig.models.gpt.GPT_PRESETS / "
                                  "albert.ALBERT_PRESETS / llama_config.LLAMA_PRESETS)."),
    "num_layers": ("integer", 0, "Override the preset's layers (0 keeps it)."),
    "hidden_size": ("integer", 0, "Override the preset's hidden size (0 keeps it)."),
    "num_heads": ("integer", 0, "Override the preset's attention heads (0 keeps it)."),
    "vocab_size": ("integer", 0, "Override the preset's vocabulary (0 keeps it)."),
    "embedding_size": ("integer", 0, "ALBERT: override the embedding size E (0 keeps it)."),
    "num_groups": ("integer", 0, "ALBERT: override the shared layer groups (0 keeps it)."),
    "dropout": ("float", -1.0, "Override the preset's dropout (its masks are kept for the "
                               "backward pass; negative keeps it)."),
    "seq_length": ("integer", 0, "Tokens per sequence (0: the preset's)."),
    "attention": ("string", "auto", "dense | blockwise | auto (blockwise from 1024 tokens on), as "
                                    "tfbig-train's: blockwise keeps no T x T term."),
    "batch_size": ("integer", 0, "Global batch in sequences (0: about 2**20 tokens, rounded up "
                                 "to a multiple of the data-parallel degree)."),
    "precision": ("string", "mixed_bfloat16", "fp32 | mixed_float16 | mixed_bfloat16 "
                                              "(default: bf16, fp16 on a GPU without bf16)."),
    "token_budget": ("float", 300e9, "Tokens to train on, for days and GPU-hours."),
    "gpu": ("string", "A100-40GB", f"GPU type: one of {list(hardware.GPUS)}."),
    "gpus_per_node": ("integer", 8, "GPUs per node (sharing NVLink)."),
    "nodes": ("integer", 1, "Nodes."),
    "internode_gbps": ("float", 400.0, "Network bandwidth per node, Gb/s per direction (400: "
                                       "p4d EFA; 3200: p5)."),
    "peak_tflops": ("float", 0.0, "A device not in the table: its peak TFLOP/s at "
                                  "--precision (with --hbm_gb)."),
    "hbm_gb": ("float", 0.0, "A device not in the table: its memory in GB."),
    "memory_gbps": ("float", 2000.0, "With --peak_tflops: memory bandwidth, GB/s."),
    "link_gbps": ("float", 300.0, "With --peak_tflops: GPU-to-GPU bandwidth in a node, GB/s."),
    "tensor_parallel": ("integer", 1, "Fix the tensor-parallel degree (searched if absent)."),
    "sequence_parallel": ("bool", False, "Fix sequence parallelism (searched: on when T > 1)."),
    "pipeline_stages": ("integer", 1, "Fix the pipeline stages (searched if absent)."),
    "context_parallel": ("integer", 1, "Fix the context-parallel degree (searched if absent)."),
    "expert_parallel": ("integer", 1, "Fix the expert-parallel degree: data ranks splitting "
                                      "each MoE layer's experts (searched if absent, for an "
                                      "MoE preset)."),
    "num_microbatches": ("integer", 1, "Fix the micro-batches per replica and step."),
    "schedule": ("string", "1f1b", "Pipeline schedule: 1f1b | gpipe (1f1b if absent)."),
    "zero_stage": ("integer", 0, "Fix the ZeRO stage 0-3 (searched if absent)."),
    "shard_degree": ("integer", 0, "Fix the ZeRO partition group size (0: all data ranks)."),
    "activation_checkpointing": ("bool", False, "Fix activation checkpointing on or off."),
    "calibration": ("string", "", "A calibration file tfbig-doctor --calibration_out wrote: "
                                  "the measured device and collectives replace the spec table "
                                  "(the spec prediction is printed beside)."),
    "top": ("integer", 5, "Layouts listed."),
    "json": ("bool", False, "Print one JSON object instead of text."),
}


def define_flags(flag_values):
    definers = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer,
                "float": flags.DEFINE_float, "bool": flags.DEFINE_bool}
    for name, (kind, default, help_text) in FLAGS_SPEC.items():
        definers[kind](name, default, help_text, flag_values=flag_values)


def shape_from_flags(values):
    """The model Shape from --model --preset and the override flags."""
    overrides = {k: values[k] or None for k in ("num_layers", "hidden_size", "num_heads",
                                                "vocab_size", "embedding_size", "num_groups",
                                                "seq_length")}
    overrides["dropout"] = values["dropout"] if values["dropout"] >= 0 else None
    overrides["attention"] = values["attention"]
    cfg = models.model_config(values["model"], values["preset"], **overrides)
    return models.shape_of(cfg, values["model"], values["seq_length"] or cfg.seq_length)


def cluster_from_flags(values):
    if values["peak_tflops"] or values["hbm_gb"]:
        device = hardware.custom_device(values["peak_tflops"], values["hbm_gb"],
                                        values["memory_gbps"], values["link_gbps"])
    else:
        device = hardware.gpu(values["gpu"], values["precision"])
    for flag in ("gpus_per_node", "nodes"):
        if values[flag] < 1:
            raise ValueError(f"--{flag}={values[flag]}: expected a positive number")
    return hardware.Cluster(device, values["gpus_per_node"], values["nodes"],
                            values["internode_gbps"] * 1e9 / 8)


def plan(values, fixed):
    """(text or JSON, estimates) for flag values (a dict) and the fixed layout flags. With
    --calibration the measured cluster is planned and the spec one's figures for the same
    layout are given beside."""
    shape, cluster = shape_from_flags(values), cluster_from_flags(values)
    spec = None
    if values["calibration"]:
        spec = cluster
        cluster = calibration_lib.cluster(calibration_lib.load(values["calibration"]),
                                          values["precision"], spec.gpus_per_node, spec.nodes,
                                          spec.internode_bandwidth)
    estimates = search.search(shape, cluster, values["precision"], values["batch_size"],
                              values["token_budget"], fixed)
    render = report.as_json if values["json"] else report.text
    beside = spec and search.evaluate(shape, estimates[0].layout, estimates[0].batch_size,
                                      values["precision"], spec, values["token_budget"])
    return render(shape, cluster, values["precision"], values["token_budget"], estimates,
                  values["top"], spec=beside), estimates


def main(argv):
    """Parse `argv` (argv[0] is the program), print the plan; returns the exit status."""
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    if any(arg in ("-h", "--help", "--helpfull") for arg in argv[1:]):
        print(__doc__ + "\n" + flag_values.get_help() + "\n\n" + cli.guide_line("tfbig-plan"))
        return 0
    try:
        rest = flag_values(argv)
    except flags.Error as error:
        print(f"tfbig-plan: {error}", file=sys.stderr)
        return 2
    if len(rest) > 1:
        print(f"tfbig-plan: unexpected arguments {rest[1:]}; every option is a --flag",
              file=sys.stderr)
        return 2
    values = {name: flag_values[name].value for name in FLAGS_SPEC}
    peaks = hardware.GPUS.get(values["gpu"], ({"bf16": 0},))[0]
    if not flag_values["precision"].present and "bf16" not in peaks:
        values["precision"] = "mixed_float16"  # V100: no bfloat16 tensor cores
    fixed = {name: values[name] for name in search.LAYOUT_FLAGS if flag_values[name].present}
    try:
        text, _ = plan(values, fixed)
    except ValueError as error:
        print(f"tfbig-plan: {error}", file=sys.stderr)
        return 2
    print(text)
    return 0


def run():
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
