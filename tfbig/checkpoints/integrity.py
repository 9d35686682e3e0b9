"""Checkpoint integrity: a size and CRC-32 per file, recorded at save, checked before restore.

Saving writes the checkpoint's files, then `PREFIX.sums.json` (last, atomically) with the byte
count and CRC-32 of each. Resuming walks the run's checkpoints newest first and restores the
first one whose files are all present, of the recorded size and checksum; damaged ones are
named in a warning and kept (renamed `FILE.damaged`, so a later save of the same step cannot
overwrite them). Nothing is deleted.

The functions take plain file lists, so a backend whose ranks write their own files (sharded
optimizer state) records and verifies them the same way:

    record(["/run/ckpt-4.rank1.index", ...], "/run/ckpt-4.rank1.sums.json")
    problems = verify("/run/ckpt-4.rank1.sums.json")   # [] when intact

and for a TensorFlow checkpoint prefix:

    record_checkpoint("/run/ckpt-4")          # after tf.train.CheckpointManager.save
    prefix, damaged = newest_intact("/run")   # "/run/ckpt-2", {"/run/ckpt-4": [...]}
"""
import glob
import json
import os
import re
import zlib

from tfbig.errors import DamagedCheckpointError

SUMS_SUFFIX = ".sums.json"
DAMAGED_SUFFIX = ".damaged"
_CHUNK = 8 << 20
_DATA_FILE = re.compile(r"\.data-(\d{5})-of-(\d{5})$")


def file_sum(path):
    """{"bytes": size, "crc32": hex} of one file, read in 8 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def record(paths, sums_path):
    """Write `sums_path`: each file's size and CRC-32, keyed by its path relative to it.

    Written to a temporary name, flushed to disk and renamed, so a crash leaves either the
    complete record or none.
    """
    base = os.path.dirname(os.path.abspath(sums_path))
    sums = {os.path.relpath(os.path.abspath(p), base): file_sum(p) for p in paths}
    tmp = sums_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"algorithm": "crc32", "files": sums}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, sums_path)
    return sums_path


def verify(sums_path):
    """What is wrong with the files `sums_path` records: a list of "file: problem" ([] if none)."""
    with open(sums_path) as f:
        recorded = json.load(f)["files"]
    base = os.path.dirname(os.path.abspath(sums_path))
    problems = []
    for name, expected in sorted(recorded.items()):
        path = os.path.join(base, name)
        if not os.path.exists(path):
            problems.append(f"{path}: missing")
            continue
        found = file_sum(path)
        if found["bytes"] != expected["bytes"]:
            problems.append(f"{path}: {found['bytes']} bytes, {expected['bytes']} recorded "
                            f"({'truncated' if found['bytes'] < expected['bytes'] else 'grown'})")
        elif found["crc32"] != expected["crc32"]:
            problems.append(f"{path}: checksum {found['crc32']}, {expected['crc32']} recorded")
    return problems


def checkpoint_files(prefix):
    """The files of TensorFlow checkpoint `prefix`: PREFIX.index and its data shards."""
    return sorted(glob.glob(glob.escape(prefix) + ".index")
                  + glob.glob(glob.escape(prefix) + ".data-?????-of-?????"))


def record_checkpoint(prefix):
    """Record the sums of checkpoint `prefix` in PREFIX.sums.json; returns that path."""
    return record(checkpoint_files(prefix), prefix + SUMS_SUFFIX)


def structure_problems(prefix):
    """Missing index or data shards, judged from the file names alone (no file is read)."""
    files = checkpoint_files(prefix)
    problems = [] if prefix + ".index" in files else [f"{prefix}.index: missing"]
    shards = [_DATA_FILE.search(f) for f in files]
    counts = {int(m.group(2)) for m in shards if m}
    for count in counts or {1}:
        for i in range(count):
            path = f"{prefix}.data-{i:05d}-of-{count:05d}"
            if path not in files:
                problems.append(f"{path}: missing")
    return problems


def _unrecorded_problems(prefix):
    """A checkpoint saved without sums (older tfbig, or a crash just after the save): read
    every tensor back; TensorFlow's reader checks its own per-tensor checksums."""
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (tf.errors.OpError, ValueError) as error:
        return [f"{prefix}: unreadable ({str(error).splitlines()[0][:200]})"]
    return []


def verify_checkpoint(prefix):
    """Problems of checkpoint `prefix` ([] when intact): missing files, then sizes and sums."""
    problems = structure_problems(prefix)
    sums = prefix + SUMS_SUFFIX
    if os.path.exists(sums):
        problems += [p for p in verify(sums) if p not in problems]
    elif not problems:
        problems = _unrecorded_problems(prefix)
    return problems


def checkpoints_newest_first(directory):
    """Checkpoint prefixes listed in DIRECTORY/checkpoint (TensorFlow's state file), as paths
    from here: get_checkpoint_state has joined relative entries to `directory` already (a
    second join broke a relative --model_dir, the main job's runs/gpt-small)."""
    import tensorflow as tf

    state = tf.train.get_checkpoint_state(directory)
    if state is None:
        return []
    return list(reversed(list(state.all_model_checkpoint_paths)
                         or [state.model_checkpoint_path]))


def _quarantined(prefix):
    """True when an earlier resume found `prefix` damaged and renamed its files."""
    return not checkpoint_files(prefix) and bool(glob.glob(glob.escape(prefix) + ".*"
                                                           + DAMAGED_SUFFIX))


def quarantine(prefix):
    """Rename the files of damaged checkpoint `prefix` to FILE.damaged; returns the new names."""
    kept = []
    for path in checkpoint_files(prefix) + glob.glob(glob.escape(prefix) + SUMS_SUFFIX):
        os.replace(path, path + DAMAGED_SUFFIX)
        kept.append(path + DAMAGED_SUFFIX)
    return kept


def newest_intact(directory, warn=None, keep_damaged=False):
    """(newest intact checkpoint prefix or None, {damaged prefix: problems}).

    warn(message) is told about each damaged checkpoint newer than the one returned, naming
    its files. With keep_damaged=True (the process that writes checkpoints) their files are
    renamed to FILE.damaged, so the resumed run's own saves cannot overwrite them. Raises
    DamagedCheckpointError, touching nothing, when checkpoints exist and none is intact.
    """
    damaged = {}
    for prefix in checkpoints_newest_first(directory):
        if _quarantined(prefix):
            continue
        problems = verify_checkpoint(prefix)
        if not problems:
            for bad, bad_problems in damaged.items():
                kept = quarantine(bad) if keep_damaged else []
                if warn:
                    warn(f"WARNING: checkpoint {bad} is damaged ({'; '.join(bad_problems)}); "
                         f"resuming from {prefix} instead"
                         + (f"; the damaged files are kept as {', '.join(kept)}" if kept else ""))
            return prefix, damaged
        damaged[prefix] = problems
    if damaged:
        raise DamagedCheckpointError(
            f"--model_dir={directory}: no intact checkpoint to resume from: "
            + "; ".join(f"{p} ({', '.join(v)})" for p, v in damaged.items())
            + ". Restore the files from a backup, or start afresh with another --model_dir "
              "(nothing was changed)")
    return None, damaged


def prune_sums(directory):
    """Remove the sums of checkpoints the manager rotated out (their .index is gone)."""
    for sums in glob.glob(os.path.join(glob.escape(directory), "*" + SUMS_SUFFIX)):
        if not os.path.exists(sums[:-len(SUMS_SUFFIX)] + ".index"):
            os.remove(sums)
