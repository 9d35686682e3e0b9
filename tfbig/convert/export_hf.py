"""A tfbig BERT, ALBERT or GPT run directory -> a Hugging Face directory (GPT: GPT-2's
layout, tfbig.convert.gpt2.export).

    config.json (model_type "bert"; hidden_act "gelu_new", the tanh GELU, or "gelu", the erf
    form, as the model computes),
    model.safetensors (BertForPreTraining names when the run has the pretraining heads, else
    BertModel's "bert."-prefixed backbone), vocab.txt, tokenizer_config.json (do_lower_case).
"""
import json
import os
import shutil

from tfbig.convert import bert_names, run_dir
from tfbig.errors import UsageError


def hf_config(config, pretraining):
    return {"architectures": ["BertForPreTraining" if pretraining else "BertModel"],
            "model_type": "bert", "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "intermediate_size": config.intermediate_size,
            "hidden_act": "gelu_new" if config.approximate_gelu else "gelu",
            "hidden_dropout_prob": config.dropout, "attention_probs_dropout_prob": config.dropout,
            "max_position_embeddings": config.seq_length,
            "type_vocab_size": config.type_vocab_size,
            "initializer_range": config.initializer_range,
            "layer_norm_eps": config.layer_norm_epsilon, "pad_token_id": 0}


def export(source_dir, output_dir):
    """Write the Hugging Face directory; returns the path of model.safetensors."""
    from safetensors.numpy import save_file

    config, saved = run_dir.read_config(source_dir, families=("bert", "albert", "gpt"))
    if os.path.exists(os.path.join(output_dir, "model.safetensors")):
        raise UsageError(f"--output_dir={output_dir} already holds a model.safetensors; choose "
                         "an empty directory")
    if saved["model_format"] == "gpt":
        from tfbig.convert import gpt2
        path, note = gpt2.export(source_dir, output_dir)
        print(note)
        return path
    weights = run_dir.read_weights(source_dir)
    if saved["model_format"] == "albert":
        return _export_albert(source_dir, output_dir, config, weights)
    google = bert_names.tfbig_to_google(weights, config.num_layers)
    tensors = bert_names.google_to_hf(google)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(output_dir, "config.json"), "w") as file:
        json.dump(hf_config(config, "mlm_head/bias" in weights), file, indent=1)
    tokenizer = saved.get("tokenizer", {})
    shutil.copyfile(os.path.join(source_dir, tokenizer.get("vocab_file", "vocab.txt")),
                    os.path.join(output_dir, "vocab.txt"))
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w") as file:
        json.dump({"tokenizer_class": "BertTokenizer",
                   "do_lower_case": tokenizer.get("lowercase", True)}, file, indent=1)
    return path


def _export_albert(source_dir, output_dir, config, weights):
    """ALBERT: config.json (model_type "albert"), model.safetensors, spiece.model."""
    from safetensors.numpy import save_file

    from tfbig.convert import albert

    tensors = albert.google_to_hf(albert.tfbig_to_google(weights, config.num_groups),
                                  config.num_groups)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(output_dir, "config.json"), "w") as file:
        json.dump(albert.hf_config(config, "mlm_head/bias" in weights), file, indent=1)
    shutil.copyfile(os.path.join(source_dir, "tokenizer.model"),
                    os.path.join(output_dir, "spiece.model"))
    return path
