"""Weighted mixtures of prepared directories: `--data_dir=pile_cc:0.6,/data/wiki:0.4`.

Why it is built this way: docs/design/notes/data.md (tfbig.data.mixture).
"""

import dataclasses
import functools
import os
import re

import numpy as np

from tfbig.data.manifest import Manifest, SplitInfo, load_manifest
from tfbig.data.shards import group_slug

CHOICE_BLOCK = 4096  # source choices drawn per numpy call
_WEIGHTED = re.compile(r"^.+:\s*[0-9.eE+-]+\s*$")
_GROUP = re.compile(r"^(?P<dir>.+?)(\[(?P<group>[^\]]+)\])?$")


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Sources (prepared directories) and their weights, in the order given."""

    data_dirs: tuple[str, ...]
    weights: tuple[float, ...]
    groups: tuple[str, ...] = ()  # per source: a --shard_by_group group of its directory, or "" (all shards)

    def __post_init__(self):
        if not self.groups:
            object.__setattr__(self, "groups", ("",) * len(self.data_dirs))

    @property
    def probabilities(self) -> np.ndarray:
        """Weights normalised to sum to 1."""
        weights = np.asarray(self.weights, dtype=np.float64)
        return weights / weights.sum()

    @property
    def names(self) -> tuple[str, ...]:
        """Short, unique source names for logs: the directories' base names (or the groups' names)."""
        names = [group_slug(group) if group else os.path.basename(os.path.normpath(d)) or d
                 for d, group in zip(self.data_dirs, self.groups)]
        return tuple(name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names))


def is_mixture(data_dir: str) -> bool:
    """True for "a:0.6,b:0.4" or a mixture file; False for one prepared directory."""
    if not data_dir or os.path.isdir(data_dir):
        return False
    return os.path.isfile(data_dir) or "," in data_dir or bool(_WEIGHTED.match(data_dir))


@functools.lru_cache(maxsize=16)
def parse_mixture(spec: str) -> Mixture:
    """The Mixture a --data_dir value names; ValueError naming the bad item otherwise."""
    if os.path.isfile(spec):
        with open(spec) as file:
            lines = [line.split("#", 1)[0].strip() for line in file]
        base, items, where = os.path.dirname(os.path.abspath(spec)), [line for line in lines if line], spec
    else:
        base, items, where = "", [item.strip() for item in spec.split(",")], f"--data_dir={spec!r}"
    dirs, weights, groups = [], [], []
    for item in items:
        path, _, weight = item.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not path or not value > 0 or not np.isfinite(value):
            raise ValueError(f"{where}: {item!r} is not 'directory:weight' with a positive weight; expected e.g. "
                             "--data_dir=/data/pile_cc:0.6,/data/wiki:0.4 or a file of such lines")
        match = _GROUP.match(path)
        dirs.append(os.path.join(base, match["dir"]) if base else match["dir"])
        groups.append(match["group"] or "")
        weights.append(value)
    if not dirs:
        raise ValueError(f"{where}: no sources; expected 'directory:weight' items")
    if len(set(zip(dirs, groups))) != len(dirs):
        raise ValueError(f"{where}: a source is listed twice; give each source once with its total weight")
    return Mixture(tuple(dirs), tuple(weights), tuple(groups))


def source_manifest(data_dir: str, group: str = "") -> Manifest:
    """The manifest of one source: a directory, or only its shards of `group` (--shard_by_group)."""
    manifest = load_manifest(data_dir)
    if not group:
        return manifest
    groups = sorted({shard.group for split in manifest.splits.values() for shard in split.shards} - {""})
    if group not in groups:
        raise ValueError(f"{data_dir}[{group}]: {manifest.path} has no shards of group {group!r}; its groups are "
                         f"{groups} (prepare with --jsonl_groups=... --shard_by_group)")
    return dataclasses.replace(manifest, splits={name: split.of_group(group) for name, split in manifest.splits.items()})


@functools.lru_cache(maxsize=16)
def mixture_manifest(spec: str) -> Manifest:
    """One manifest for the whole mixture: each split lists every source's shards (absolute paths).

    Its tokenizer, format, seq_length and vocab_size are the sources' (which must agree);
    info["mixture"] lists the sources and weights.
    """
    mixture = parse_mixture(spec)
    manifests = [source_manifest(d, group) for d, group in zip(mixture.data_dirs, mixture.groups)]
    first = manifests[0]
    for manifest in manifests[1:]:
        for field in ("format", "seq_length", "vocab_size", "tokenizer_sha256"):
            if getattr(manifest, field) != getattr(first, field):
                raise ValueError(f"--data_dir={spec!r}: {manifest.data_dir} has {field}={getattr(manifest, field)!r} "
                                 f"but {first.data_dir} has {getattr(first, field)!r}; a mixture's sources must be "
                                 "prepared with the same tokenizer (tfbig-prep --tokenizer=...), format and seq_length")
    splits = {}
    for name in sorted({split for manifest in manifests for split in manifest.splits}):
        shards = [dataclasses.replace(shard, file=os.path.join(os.path.abspath(manifest.data_dir), shard.file))
                  for manifest in manifests if name in manifest.splits for shard in manifest.splits[name].shards]
        splits[name] = SplitInfo(tuple(shards))
    sources = [{"data_dir": d, "group": g, "weight": w}
               for d, g, w in zip(mixture.data_dirs, mixture.groups, mixture.weights)]
    return dataclasses.replace(first, splits=splits, info={**first.info, "mixture": sources})


def block_choices(probabilities: np.ndarray, seed: int, block: int) -> np.ndarray:
    """Source index of examples [block * CHOICE_BLOCK, (block + 1) * CHOICE_BLOCK)."""
    uniform = np.random.default_rng([seed, block]).random(CHOICE_BLOCK)
    return np.minimum(np.searchsorted(np.cumsum(probabilities), uniform, side="right"),
                      len(probabilities) - 1).astype(np.int64)


def source_counts(probabilities: np.ndarray, seed: int, stop: int, start: int = 0) -> np.ndarray:
    """How many of the examples [start, stop) each source gives (int64 per source)."""
    counts = np.zeros(len(probabilities), dtype=np.int64)
    for block in range(start // CHOICE_BLOCK, -(-stop // CHOICE_BLOCK)):
        lo, hi = block * CHOICE_BLOCK, (block + 1) * CHOICE_BLOCK
        chosen = block_choices(probabilities, seed, block)[max(start, lo) - lo:min(stop, hi) - lo]
        counts += np.bincount(chosen, minlength=len(probabilities))
    return counts


_COUNTED: dict[tuple[str, int], tuple[int, np.ndarray]] = {}


def source_tokens(data_dir: str, seed: int, examples: int) -> dict[str, float]:
    """{"tokens/<source>": tokens read from it so far} for a mixture; {} for one directory.

    `examples`: global examples consumed (every replica's together). Tokens per example are the
    source's stored tokens per record (exactly seq_length + 1 for GPT). Counting is incremental
    across calls (the trainer logs it every --log_every steps).
    """
    if not is_mixture(data_dir):
        return {}
    mixture = parse_mixture(data_dir)
    done, counts = _COUNTED.get((data_dir, seed), (0, np.zeros(len(mixture.data_dirs), dtype=np.int64)))
    if examples < done:
        done, counts = 0, np.zeros_like(counts)
    counts = counts + source_counts(mixture.probabilities, seed, examples, done)
    _COUNTED[data_dir, seed] = (examples, counts)
    result = {}
    for name, data_dir_i, group, count in zip(mixture.names, mixture.data_dirs, mixture.groups, counts):
        train = source_manifest(data_dir_i, group).split("train")
        result[f"tokens/{name}"] = float(count * train.tokens / max(train.records, 1))
    return result


def open_manifest(data_dir: str) -> Manifest:
    """The manifest of one prepared directory, or of a mixture (`mixture_manifest`), for
    training on it: the tokenizer it names must be there (a run copies it)."""
    manifest = mixture_manifest(data_dir) if is_mixture(data_dir) else load_manifest(data_dir)
    manifest.check_tokenizer()
    return manifest
