"""One global, seeded order of examples, read by position: the same data whatever the layout.

Why it is built this way: docs/design/notes/data.md (tfbig.data.order).
"""

import functools
import os
import sys

import numpy as np

from tfbig.data import mixture

_HEADER_BYTES = 12  # uint64 length + masked CRC-32C of it; the data's CRC follows the data


class ShardIndex:
    """Byte offset and length of every record of one TFRecord shard.

    Built by reading the shard once with TensorFlow's reader (which checks every CRC). A shard
    that is corrupt, truncated or holds another count than its manifest entry raises a
    ValueError naming it; with `skip_corrupt` its intact records before the damage are kept
    and a warning says how many were lost.
    """

    def __init__(self, path: str, expected: int, skip_corrupt: bool = False):
        from tensorflow.python.lib.io import tf_record  # the seeking reader; TF only here

        self.path = path
        reader, offsets, lengths, offset, problem = tf_record.tf_record_random_reader(path), [], [], 0, None
        while len(offsets) < expected + 1:
            try:
                record, following = reader.read(offset)
            except IndexError:  # the end of the file
                break
            except Exception as error:  # DataLossError: a bad CRC or a record cut short
                problem = f"{type(error).__name__}: {error}"
                break
            offsets.append(offset + _HEADER_BYTES)
            lengths.append(len(record))
            offset = following
        if len(offsets) != expected or problem:
            message = (f"shard {path} is corrupt or truncated: read {len(offsets)} of {expected} records "
                       "listed in manifest.json")
            if not skip_corrupt or len(offsets) > expected:
                raise ValueError(message + "; prepare the data again or pass --skip_corrupt")
            print(f"WARNING: tfbig.data: {message} ({problem or 'the file ends early'}); skipped the rest of it",
                  file=sys.stderr, flush=True)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)


@functools.lru_cache(maxsize=64)
def shard_index(path: str, expected: int, skip_corrupt: bool, mtime_ns: int, size: int) -> ShardIndex:
    """`ShardIndex`, built once per process for a file version (mtime and size are the key)."""
    del mtime_ns, size
    return ShardIndex(path, expected, skip_corrupt)


class RecordReader:
    """The records of one split of one directory, in its global order (see the module docstring)."""

    def __init__(self, paths: list[str], counts: list[int], seed: int, shuffle: bool, skip_corrupt: bool = False):
        indexes = []
        for path, count in zip(paths, counts):
            stat = os.stat(path)
            indexes.append(shard_index(path, count, skip_corrupt, stat.st_mtime_ns, stat.st_size))
        self.paths = list(paths)
        self.seed, self.shuffle = tuple(np.atleast_1d(seed).tolist()), shuffle  # an int or (seed, source)
        self.shard = np.concatenate([np.full(len(index), i, np.int32) for i, index in enumerate(indexes)])
        self.offsets = np.concatenate([index.offsets for index in indexes])
        self.lengths = np.concatenate([index.lengths for index in indexes])
        self.num_records = len(self.offsets)
        if not self.num_records:
            raise ValueError(f"no intact records in {', '.join(paths)}")
        self._files: dict[int, int] = {}
        self._permutations: dict[int, np.ndarray] = {}

    @classmethod
    def for_split(cls, manifest, split: str, seed, shuffle: bool, skip_corrupt: bool = False) -> "RecordReader":
        """The reader of `manifest`'s `split` (ValueError naming the manifest if it has no shards)."""
        shards = manifest.split(split).shards
        if not shards:
            raise ValueError(f"{manifest.path}: split {split!r} has no shards")
        return _cached_reader(tuple(manifest.shard_paths(split)), tuple(s.records for s in shards), tuple(np.atleast_1d(seed).tolist()), shuffle,
                              skip_corrupt)

    def records(self, positions: np.ndarray) -> np.ndarray:
        """Record numbers (in manifest order) of global `positions`."""
        epochs, within = np.divmod(np.asarray(positions, np.int64), self.num_records)
        if not self.shuffle:
            return within
        result = np.empty_like(within)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            result[chosen] = self._permutation(int(epoch))[within[chosen]]
        return result

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a batch spans at most two epochs
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = np.random.default_rng([*self.seed, epoch]).permutation(self.num_records)
        return self._permutations[epoch]

    def read(self, positions: np.ndarray) -> np.ndarray:
        """Serialized records at global `positions` (an object array of bytes)."""
        return self.read_records(self.records(positions))

    def read_records(self, records: np.ndarray) -> np.ndarray:
        """Serialized records by record number (manifest order)."""
        out = np.empty(len(records), dtype=object)
        for i, record in enumerate(records):
            out[i] = os.pread(self._file(int(self.shard[record])), int(self.lengths[record]),
                              int(self.offsets[record]))
        return out

    def _file(self, shard: int) -> int:
        if shard not in self._files:
            self._files[shard] = os.open(self.paths[shard], os.O_RDONLY)
        return self._files[shard]


@functools.lru_cache(maxsize=32)
def _cached_reader(paths, counts, seed, shuffle, skip_corrupt) -> RecordReader:
    return RecordReader(list(paths), list(counts), seed, shuffle, skip_corrupt)


class MixtureOrder:
    """Global order of a weighted mixture: position p comes from source `block_choices(...)[p]`,
    at that source's next own position (how many earlier positions chose it)."""

    def __init__(self, readers: list[RecordReader], probabilities: np.ndarray, seed: int):
        self.readers, self.probabilities, self.seed = readers, probabilities, seed
        self._block_starts = {0: np.zeros(len(readers), np.int64)}  # block -> per-source counts before it

    def _counts_before(self, block: int) -> np.ndarray:
        known = max(b for b in self._block_starts if b <= block)
        counts = self._block_starts[known].copy()
        for b in range(known, block):
            counts += np.bincount(self._choices(b), minlength=len(self.readers))
            self._block_starts[b + 1] = counts.copy()
        return counts

    def _choices(self, block: int) -> np.ndarray:
        return mixture.block_choices(self.probabilities, self.seed, block)

    @functools.lru_cache(maxsize=4)
    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's own position) of each position of one choice block."""
        choices = self._choices(block)
        chosen = choices[:, None] == np.arange(len(self.readers))[None, :]  # (CHOICE_BLOCK, sources)
        earlier = np.cumsum(chosen, axis=0)[np.arange(len(choices)), choices] - 1  # same source, same block
        return choices, self._counts_before(block)[choices] + earlier

    def read(self, positions: np.ndarray) -> np.ndarray:
        """Serialized records at global mixture `positions`."""
        positions = np.asarray(positions, np.int64)
        out = np.empty(len(positions), dtype=object)
        blocks, within = np.divmod(positions, mixture.CHOICE_BLOCK)
        for block in np.unique(blocks):
            sources, own = self._block(int(block))
            here = np.flatnonzero(blocks == block)
            for source in np.unique(sources[within[here]]):
                mine = here[sources[within[here]] == source]
                out[mine] = self.readers[source].read(own[within[mine]])
        return out
