"""Bytes a rank reads from a checkpoint to start a split layout (--init_checkpoint): the
memory-mapped reader (tfbig.checkpoints.bundle) against TensorFlow's, which reads every weight
whole.

Writes one block of a Llama-class model (default: Llama 3.2 1B's shapes, float32: q, k, v, o,
gate, up, down, 232 MiB) as a checkpoint, then for each layout loads one rank's pieces
(tfbig.convert.init_checkpoint.load with that layout's cuts: a tensor rank's heads and columns
and its rows of o and down, a ZeRO-3 rank's flat slice, an expert rank's rows standing in for
its experts) after dropping the data file from the page cache (fsync + POSIX_FADV_DONTNEED),
and counts the file's pages the load brought into the cache (mincore): the bytes read from
disk, with the kernel's read-around of the pages a cut touches (up to the device's read-ahead
window, printed as read_ahead_kb). Needs a file system that honours DONTNEED (not tmpfs).

    python benchmarks/sliced_load.py [--hidden=2048 --ffn=8192 --kv=512 --dir=/var/tmp/x]
    python benchmarks/sliced_load.py --experts=8 [--hidden=1024 --ffn=3584 --kv=256]

With --experts=E it writes instead a Hugging Face Mixtral directory of one block (its E experts'
w1, w3, w2 one tensor each, as Hugging Face stores them; tfbig holds one stacked weight per
matrix) and loads an expert rank's pieces (rank 3 of 8: its experts, the rest whole) and a
ZeRO-3 rank's (flat slices of every weight, the stacked experts' included) from it in place,
against reading the directory whole (tfbig-convert's path).

Prints one JSON line: per layout, the bytes read, the piece's bytes and their ratio, the
whole-file bytes TensorFlow's reader read for the same pieces, and the wall seconds of each
from a cold page cache (the mapped reader's timing includes assigning the pieces).
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import ctypes
import json
import mmap
import os
import shutil
import tempfile
import time
import types

import numpy as np


def resident_bytes(path):
    """Bytes of `path` in the page cache (mincore over a mapping that touches nothing)."""
    size = os.path.getsize(path)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) as mm:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        address = np.frombuffer(mm, np.uint8).ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec):
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec) * mmap.PAGESIZE


def read_ahead_kb(path):
    """The read-ahead window of the block device holding `path` (None where /sys has none)."""
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        if os.path.exists(queue):
            with open(queue) as file:
                return int(file.read())
    return None


def evict(path):
    with open(path, "rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def measure(directory, files, shapes, layouts, whole, whole_name):
    """Per layout ({name: key -> cut or None}): the bytes of `files` (the checkpoint at
    `directory`) and the seconds init_checkpoint.load takes for one rank's pieces from a cold
    page cache, against `whole()` ({key: full array}, the baseline reader) cut alike; the
    pieces are checked equal."""
    import tensorflow as tf

    from tfbig.convert import init_checkpoint

    for path in files:
        evict(path)
    if sum(resident_bytes(p) for p in files) > sum(os.path.getsize(p) for p in files) // 10:
        raise SystemExit(f"{directory}: the page cache kept the files after "
                         "POSIX_FADV_DONTNEED (tmpfs?); give --dir on a disk")
    results = []
    for name, cut_of in layouts.items():
        cuts = {k: cut_of(k) for k in shapes}
        holders = {k: tf.Variable(tf.zeros(s if cuts[k] is None else
                                           cuts[k](np.zeros(s, np.float32)).shape))
                   for k, s in shapes.items()}
        for path in files:
            evict(path)
        start = time.perf_counter()
        init_checkpoint.load(types.SimpleNamespace(name="model"), directory,
                             {k: [holders[k], cuts[k], s] for k, s in shapes.items()})
        seconds = time.perf_counter() - start
        mapped = sum(resident_bytes(p) for p in files)
        for path in files:
            evict(path)
        start = time.perf_counter()
        weights = whole()
        pieces = {k: weights[k] if cuts[k] is None else cuts[k](weights[k]) for k in shapes}
        whole_seconds = time.perf_counter() - start
        for k in shapes:
            np.testing.assert_array_equal(pieces[k], holders[k].numpy())
        piece = sum(4 * int(np.prod(v.shape)) for v in holders.values())
        results.append({"layout": name, "mapped": mapped,
                        whole_name: sum(resident_bytes(p) for p in files),
                        "piece_bytes": piece, "ratio_read_to_piece": round(mapped / piece, 3),
                        "seconds_mapped": round(seconds, 3),
                        f"seconds_{whole_name}": round(whole_seconds, 3)})
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=0, help="default 2048 (experts: 1024)")
    parser.add_argument("--ffn", type=int, default=0, help="default 8192 (an expert's: 3584)")
    parser.add_argument("--kv", type=int, default=0,
                        help="key/value width (GQA); default 512 (experts: 256)")
    parser.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    parser.add_argument("--experts", type=int, default=0,
                        help="a Hugging Face Mixtral block with this many experts instead")
    args = parser.parse_args()
    if args.experts:
        return huggingface_experts(args)
    import tensorflow as tf

    from tfbig.convert import run_dir
    from tfbig.distribute.zero3 import Partition
    from tfbig.layouts.tensor_layout import take_slice

    h, f, kv = args.hidden or 2048, args.ffn or 8192, args.kv or 512
    shapes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, f),
              "up": (h, f), "down": (f, h)}
    root = args.dir or tempfile.mkdtemp(dir="/var/tmp")
    rng = np.random.default_rng(0)
    tf.train.Checkpoint(model=tf.train.Checkpoint(**{
        k: tf.Variable(rng.standard_normal(s, np.float32)) for k, s in shapes.items()})).save(
        os.path.join(root, "ckpt"))
    (data,) = [os.path.join(root, n) for n in os.listdir(root) if ".data-" in n]
    rows = ("o", "down")  # row-parallel under tensor parallelism
    layouts = {
        "tp2": lambda k: (lambda w: take_slice(w, 0 if k in rows else -1, 1, 1, 2)),
        "tp8": lambda k: (lambda w: take_slice(w, 0 if k in rows else -1, 1, 3, 8)),
        "zero3_of_8": lambda k: (lambda w: Partition(None, 8, 3).own(w, w.shape)),
        "rows_of_8": lambda k: (lambda w: take_slice(w, 0, 1, 3, 8)),
    }
    file_bytes, ahead = os.path.getsize(data), read_ahead_kb(data)

    def whole():  # TensorFlow's reader, as before
        _, read = run_dir.weight_reader(root)
        return {k: read(k) for k in shapes}

    results = measure(root, [data], shapes, layouts, whole, "tensorflow")
    if not args.dir:
        shutil.rmtree(root)
    _record.emit({"benchmark": "sliced_load", "file_bytes": file_bytes,
                  "read_ahead_kb": ahead,
                  "shapes": {k: list(s) for k, s in shapes.items()}, "layouts": results})


def huggingface_experts(args):
    """--experts=E: a rank's pieces of a Hugging Face Mixtral block read in place."""
    from tfbig.convert import llama, llama_names, moe_names
    from tfbig.distribute.zero3 import Partition
    from tfbig.layouts.tensor_layout import take_slice
    from tfbig.models.llama_config import LlamaConfig

    h, f, kv, e = args.hidden or 1024, args.ffn or 3584, args.kv or 256, args.experts
    config = LlamaConfig(num_layers=1, hidden_size=h, num_heads=h // 64, num_kv_heads=kv // 64,
                         moe_intermediate_size=f, num_experts=e, experts_per_token=2,
                         vocab_size=256, seq_length=4096)
    shapes = {**llama_names.shapes(config),
              **{key: moe_names.expert_shape(config, matrix, bank)
                 for key, _, _, matrix, bank in moe_names.rows(config)}}
    root = args.dir or tempfile.mkdtemp(dir="/var/tmp")
    rng = np.random.default_rng(0)
    llama.write_huggingface(os.path.join(root, "hf"), config, {
        k: rng.standard_normal(s, np.float32) for k, s in shapes.items()})
    files = [os.path.join(root, "hf", n) for n in os.listdir(os.path.join(root, "hf"))
             if n.endswith(".safetensors")]
    experts = {key for key, *_ in moe_names.rows(config)}
    layouts = {
        "experts_of_8": lambda k: ((lambda w: take_slice(w, 0, 1, 3, 8)) if k in experts
                                   else None),
        "zero3_of_8": lambda k: (lambda w: Partition(None, 8, 3).own(w, w.shape)),
    }
    results = measure(os.path.join(root, "hf"), files, shapes, layouts,
                      lambda: llama.read_huggingface(os.path.join(root, "hf"))[1],  # convert's
                      "whole")
    file_bytes, ahead = sum(os.path.getsize(p) for p in files), read_ahead_kb(files[0])
    if not args.dir:
        shutil.rmtree(root)
    _record.emit({"benchmark": "sliced_load", "source": "huggingface_mixtral",
                  "file_bytes": file_bytes, "read_ahead_kb": ahead, "experts": e,
                  "shapes": {k: list(s) for k, s in shapes.items()}, "layouts": results})


if __name__ == "__main__":
    main()
