"""A TensorFlow checkpoint's tensors as memory-mapped arrays: a rank that needs a slice of a
weight reads that slice's bytes, not the whole weight.

TensorFlow's own reader (tf.train.load_checkpoint, RestoreV2 with a slice spec) reads every
stored tensor whole, also when a slice is asked for. A checkpoint (the V2 "tensor bundle") is an
index (a LevelDB-format table: key -> BundleEntryProto with the data shard, offset, size, dtype
and shape of each tensor) beside data files holding each tensor's raw bytes in C order, so a
tensor can be mapped where it lies: numpy slicing of the map touches only the pages the slice
covers (the OS reads those, with its read-around), and the consumer copies the slice out.

`tensors(prefix)` parses the index (uncompressed blocks, as TensorFlow writes them; a
compressed block, a big-endian bundle or a tensor stored in slices is left to TensorFlow's
reader). A data file shorter than its index says is refused by name. The per-tensor CRC32C
TensorFlow's reader checks covers a whole tensor, so a mapped slice is not checked against it
(tfbig's own checkpoints carry file sums: tfbig.checkpoints.integrity).
The format: tensorflow/core/util/tensor_bundle/tensor_bundle.h and table_builder.cc.
"""
import os
import struct

import numpy as np

from tfbig.errors import UsageError

FOOTER = 48  # metaindex handle, index handle (varints, padded), 8-byte magic
MAGIC = 0xDB4775248B80FB57
UNCOMPRESSED = 0


def _varint(data, at):
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _block(data, handle, at=0):
    """The contents of the block of `data` whose handle (offset, size varints) starts at
    `handle[at]`; None when the block is compressed."""
    offset, at = _varint(handle, at)
    size, _ = _varint(handle, at)
    if data[offset + size] != UNCOMPRESSED:  # the 5-byte trailer: type, crc32c
        return None
    return data[offset:offset + size]


def _entries(block):
    """(key, value) of every entry of a table block (keys prefix-compressed)."""
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end, at, key = len(block) - 4 - 4 * restarts, 0, b""
    while at < end:
        shared, at = _varint(block, at)
        unshared, at = _varint(block, at)
        size, at = _varint(block, at)
        key = key[:shared] + bytes(block[at:at + unshared])
        at += unshared
        yield key, block[at:at + size]
        at += size


def tensors(prefix):
    """{checkpoint key: (data file, offset, numpy dtype, shape)} of every tensor of the
    checkpoint `prefix` (its `.index` beside it) stored whole; None when the index cannot be
    read here (a compressed block)."""
    import tensorflow as tf
    from tensorflow.core.protobuf import tensor_bundle_pb2

    with open(prefix + ".index", "rb") as file:
        data = memoryview(file.read())
    if len(data) < FOOTER or struct.unpack_from("<Q", data, len(data) - 8)[0] != MAGIC:
        raise ValueError(f"{prefix}.index is not a TensorFlow checkpoint index")
    _, at = _varint(data, len(data) - FOOTER)  # skip the metaindex handle
    _, at = _varint(data, at)
    index = _block(data, data, at)
    if index is None:
        return None
    header, found = tensor_bundle_pb2.BundleHeaderProto(), {}
    for _, handle in _entries(index):
        block = _block(data, handle)
        if block is None:
            return None
        for key, value in _entries(block):
            if not key:  # the empty key holds the header
                header.ParseFromString(bytes(value))
                continue
            entry = tensor_bundle_pb2.BundleEntryProto.FromString(bytes(value))
            dtype = tf.dtypes.as_dtype(entry.dtype)
            if entry.slices or dtype == tf.string or not dtype.is_numpy_compatible:
                continue
            shape = tuple(d.size for d in entry.shape.dim)
            found[key.decode()] = (entry.shard_id, entry.offset, entry.size,
                                   dtype.as_numpy_dtype, shape)
    if header.endianness != tensor_bundle_pb2.BundleHeaderProto.LITTLE:
        return None
    shards, sizes, places = header.num_shards or 1, {}, {}
    for key, (shard, offset, size, dtype, shape) in found.items():
        path = f"{prefix}.data-{shard:05d}-of-{shards:05d}"
        if path not in sizes:
            sizes[path] = os.path.getsize(path) if os.path.exists(path) else -1
        if offset + size > sizes[path]:  # a map past the end would fault when read
            raise UsageError(f"{path}: {key} ends at byte {offset + size}, the file has "
                             f"{max(sizes[path], 0)}: the checkpoint is truncated or missing "
                             "a file")
        places[key] = (path, offset, dtype, shape)
    return places


def mapped(location):
    """The tensor at `location` (a `tensors` value), memory-mapped read-only: nothing is read
    until it is used, and then the pages used and the kernel's read-around of them."""
    path, offset, dtype, shape = location
    if not int(np.prod(shape)):
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


class Stacked:
    """Arrays of one shape, each read when asked for, stacked on a new first axis: a Hugging
    Face mixture-of-experts checkpoint stores each expert's matrix as a tensor of its own, a
    tfbig MoE layer one (E, ...) weight per matrix. An expert rank's rows (`rows`: the cut of
    tfbig.layouts.tensor_layout.take_slice) read only its experts; a flat range (`flat_range`:
    ZeRO-3's) only the experts it covers; anything else reads all (`np.asarray`)."""

    def __init__(self, parts, shape):
        self.parts = list(parts)  # zero-argument callables, each one expert's array
        self.shape = tuple(shape)
        if len(self.parts) != self.shape[0]:
            raise ValueError(f"{len(self.parts)} parts for a stacked shape {self.shape}")

    @property
    def ndim(self):
        return len(self.shape)

    def _part(self, j):
        return np.asarray(self.parts[j](), np.float32)

    def rows(self, start, stop):
        """Parts start..stop-1, stacked (float32)."""
        return np.stack([self._part(j) for j in range(start, stop)])

    def flat_range(self, start, stop):
        """Elements start..stop-1 of the stacked array in C order (float32)."""
        size = int(np.prod(self.shape[1:]))
        pieces = [self._part(j).reshape(-1)[max(start - j * size, 0):min(stop - j * size, size)]
                  for j in range(start // size, min(-(-stop // size), len(self.parts)))]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def __array__(self, dtype=None, copy=None):
        whole = self.rows(0, len(self.parts))
        return whole if dtype is None else whole.astype(dtype)
