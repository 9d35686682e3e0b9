"""Time tfbig-convert on a gpt2-medium-sized random Hugging Face directory (24 layers, n_embd
1024, vocab 50257, n_positions 1024: 355M parameters, 1.4 GB fp32, and a 50257-token BPE
vocabulary), in and back out (--to=huggingface), against just reading its model.safetensors
(the floor any converter pays) in the same run. Prints one JSON line.

    python benchmarks/convert_gpt2.py [--dir=/tmp/bench_convert_gpt2]
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

MEDIUM = dict(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16)


def write_bpe(directory, vocab_size):
    """A valid byte-level BPE: the 256 byte characters, pairs of them merged, <|endoftext|>."""
    from tfbig.data.bpe import _byte_of_char

    chars = sorted(_byte_of_char(), key=_byte_of_char().get)
    pairs = [(a, b) for a in chars for b in chars][:vocab_size - 257]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({a + b: 256 + i for i, (a, b) in enumerate(pairs)})
    vocab["<|endoftext|>"] = len(vocab)
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as file:
        json.dump(vocab, file, ensure_ascii=False)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as file:
        file.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in pairs))


def write_hf(directory):
    from safetensors.numpy import save_file

    from tfbig.convert import gpt2

    config = gpt2.config_from_hf(MEDIUM, "gpt2-medium")
    rng = np.random.default_rng(0)
    tensors = {"transformer." + gpt2.names(config)[key]: rng.standard_normal(shape, np.float32)
               * 0.02 for key, shape in gpt2.shapes(config).items()}
    os.makedirs(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump({"model_type": "gpt2", **MEDIUM}, file)
    write_bpe(directory, config.vocab_size)
    return config


def timed(*args):
    start = time.perf_counter()  # the command as users run it, TensorFlow start-up included
    subprocess.run([sys.executable, "-m", "tfbig.convert", *args], check=True,
                   capture_output=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/bench_convert_gpt2")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    source, run, out = (os.path.join(args.dir, n) for n in ("hf", "run", "exported"))
    config = write_hf(source)
    from safetensors.numpy import load_file

    start = time.perf_counter()
    load_file(os.path.join(source, "model.safetensors"))
    read_seconds = time.perf_counter() - start
    convert_seconds = timed(f"--source={source}", f"--output_dir={run}")
    export_seconds = timed(f"--source={run}", "--to=huggingface", f"--output_dir={out}")
    load = os.getloadavg()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    _record.emit({"benchmark": "convert_gpt2", "size": "gpt2-medium",
                      "params": config.num_params(), "convert_seconds": round(convert_seconds, 1),
                      "export_seconds": round(export_seconds, 1),
                      "read_safetensors_seconds": round(read_seconds, 2),
                      "convert_over_read": round(convert_seconds / read_seconds, 1),
                      "export_over_read": round(export_seconds / read_seconds, 1),
                      "load_average": load, "cpu": cpu})
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
