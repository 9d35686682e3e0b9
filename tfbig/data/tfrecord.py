"""TFRecord files of `tf.train.Example`s, written with numpy alone (no TensorFlow import).

Why not `tf.io.TFRecordWriter`: prep workers are separate processes, and importing
TensorFlow costs ~4 s per process, more than tokenizing a small corpus. The formats
here are small and fixed, and the tests check the bytes against TensorFlow's own
serializer and writer:

- an Example holds features that are each an int64 list (packed varints) or a float
  list (packed float32);
- a TFRecord is `uint64 length | masked crc32c(length) | data | masked crc32c(data)`.

Example:
    with RecordWriter("/tmp/x.tfrecord") as writer:
        writer.write(encode_examples({"input_ids": np.array([[1, 2, 3]])}))
"""

import hashlib
import os
import struct

import numpy as np


def _crc32c_table() -> np.ndarray:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = np.zeros(256, dtype=np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table[byte] = crc
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(records: list[bytes]) -> np.ndarray:
    """CRC-32C of each byte string, computed for all of them at once (uint32 array).

    The loop runs over byte positions, not records, so its cost is the longest record's
    length in numpy steps; records of one shard have nearly equal lengths.
    """
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    width = int(lengths.max(initial=0))
    padded = np.zeros((len(records), width), dtype=np.uint8)
    for row, record in enumerate(records):
        padded[row, : len(record)] = np.frombuffer(record, dtype=np.uint8)
    columns = np.ascontiguousarray(padded.T)  # (width, N): one column per step
    crc = np.full(len(records), 0xFFFFFFFF, dtype=np.uint32)
    shortest = int(lengths.min(initial=0))
    for position in range(width):
        updated = _CRC_TABLE[(crc ^ columns[position]) & 0xFF] ^ (crc >> 8)
        crc = updated if position < shortest else np.where(position < lengths, updated, crc)
    return crc ^ np.uint32(0xFFFFFFFF)


def masked_crc32c(records: list[bytes]) -> np.ndarray:
    """The CRC TFRecord stores: rotated right by 15 bits plus a constant (uint32 array)."""
    crc = crc32c(records).astype(np.uint64)
    rotated = ((crc >> np.uint64(15)) | (crc << np.uint64(17))) & np.uint64(0xFFFFFFFF)
    return ((rotated + np.uint64(0xA282EAD8)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _packed_varints(values: np.ndarray) -> list[bytes]:
    """Protobuf varint encoding of each row of a non-negative (N, L) int array."""
    values = np.asarray(values, dtype=np.uint64)
    if values.size and int(values.min()) < 0:
        raise ValueError("int64 features must be non-negative here")
    num_bytes = np.ones(values.shape, dtype=np.int64)
    for shift in range(7, 64, 7):
        num_bytes += values >= np.uint64(1 << shift)
    width = int(num_bytes.max(initial=1))
    shifts = np.arange(width, dtype=np.uint64) * np.uint64(7)
    groups = ((values[..., None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)  # (N, L, K)
    more = np.arange(width) < (num_bytes[..., None] - 1)
    groups |= more.astype(np.uint8) << 7
    flat = groups[np.arange(width) < num_bytes[..., None]].tobytes()
    ends = np.cumsum(num_bytes.sum(axis=1))
    starts = np.concatenate([[0], ends[:-1]])
    return [flat[start:end] for start, end in zip(starts.tolist(), ends.tolist())]


def _packed_floats(values: np.ndarray) -> list[bytes]:
    return [row.tobytes() for row in np.asarray(values, dtype="<f4")]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_examples(features: dict[str, np.ndarray]) -> list[bytes]:
    """Serialize N `tf.train.Example`s from feature name -> (N, L) arrays.

    Integer arrays become int64 lists (values must be >= 0), floating arrays float lists.
    """
    encoded = []
    for name, values in features.items():
        values = np.asarray(values)
        if values.ndim != 2:
            raise ValueError(f"feature {name!r}: expected a (N, L) array, got shape {values.shape}")
        if np.issubdtype(values.dtype, np.floating):
            kind, rows = 2, _packed_floats(values)  # Feature.float_list
        else:
            kind, rows = 3, _packed_varints(values)  # Feature.int64_list
        key = _field(1, name.encode())
        encoded.append([_field(1, key + _field(2, _field(kind, _field(1, row)))) for row in rows])
    return [_field(1, b"".join(entries)) for entries in zip(*encoded)]


def frame_records(records: list[bytes]) -> bytes:
    """Concatenate records in TFRecord framing: length, its CRC, data, its CRC."""
    lengths = [struct.pack("<Q", len(r)) for r in records]
    length_crcs = masked_crc32c(lengths).tolist()
    data_crcs = masked_crc32c(records).tolist()
    parts = []
    for length, length_crc, record, data_crc in zip(lengths, length_crcs, records, data_crcs):
        parts += [length, struct.pack("<I", length_crc), record, struct.pack("<I", data_crc)]
    return b"".join(parts)


class RecordWriter:
    """Write TFRecords to `path`, keeping the file's sha256 and size as it goes."""

    def __init__(self, path: str):
        self.path = path
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0
        self._file = open(path, "wb")

    def write(self, records: list[bytes]) -> None:
        """Append serialized records (e.g. from `encode_examples`)."""
        if not records:
            return
        data = frame_records(records)
        self._file.write(data)
        self.sha256.update(data)
        self.num_bytes += len(data)

    def close(self) -> None:
        """Flush and fsync, so a rename after close never exposes a partial file."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
