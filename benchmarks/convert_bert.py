"""Time tfbig-convert on a BERT-large-sized random Hugging Face directory (24 layers, H 1024,
vocab 30522: 335M backbone parameters, 1.3 GB fp32), against just reading its
model.safetensors (the floor any converter pays) in the same run. Prints one JSON line.

    python benchmarks/convert_bert.py [--preset=large] [--dir=/tmp/bench_convert]
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np


def write_hf(directory, preset):
    from safetensors.numpy import save_file

    from tfbig.convert import bert_names
    from tfbig.models.configs import BertConfig

    config = BertConfig.from_preset(preset)
    rng = np.random.default_rng(0)
    google = {name: rng.standard_normal(shape, np.float32) * 0.02
              for name, shape in bert_names.google_shapes(config).items()}
    os.makedirs(directory)
    save_file(bert_names.google_to_hf(google), os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump({"model_type": "bert", "vocab_size": config.vocab_size,
                   "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
                   "num_attention_heads": config.num_heads,
                   "intermediate_size": config.intermediate_size,
                   "max_position_embeddings": config.seq_length}, file)
    with open(os.path.join(directory, "vocab.txt"), "w") as file:
        file.write("\n".join(["[PAD]", "[UNK]"] + [f"w{i}" for i in range(config.vocab_size - 2)]))
    return config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="large")
    parser.add_argument("--dir", default="/tmp/bench_convert")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    source, output = os.path.join(args.dir, "hf"), os.path.join(args.dir, "run")
    config = write_hf(source, args.preset)
    from safetensors.numpy import load_file

    start = time.perf_counter()
    load_file(os.path.join(source, "model.safetensors"))
    read_seconds = time.perf_counter() - start
    start = time.perf_counter()  # the command as users run it, TensorFlow start-up included
    subprocess.run([sys.executable, "-m", "tfbig.convert", f"--source={source}",
                    f"--output_dir={output}"], check=True, capture_output=True)
    convert_seconds = time.perf_counter() - start
    load = os.getloadavg()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    _record.emit({"benchmark": "convert_bert", "preset": args.preset,
                      "params": config.num_params(), "convert_seconds": round(convert_seconds, 1),
                      "read_safetensors_seconds": round(read_seconds, 2),
                      "convert_over_read": round(convert_seconds / read_seconds, 1),
                      "load_average": load, "cpu": cpu})
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
