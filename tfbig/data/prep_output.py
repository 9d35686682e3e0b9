"""What an output directory of tfbig-prep already holds: the settings it was prepared with
(refused when they conflict, unless --overwrite), a finished preparation whose shards are
intact (then nothing is done again), and the stale files a new one leaves behind."""
import hashlib
import json
import os
import re

from absl import logging

from tfbig.data import shards, source_spec
from tfbig.data.manifest import MANIFEST_NAME, Manifest, load_manifest

_SHARD_FILE = re.compile(r"^(train|validation)(-[\w-]+)?-\d{5}-of-\d{5}\.tfrecord(?P<suffix>\.done|\.tmp)?$")


def existing_config(output_dir: str) -> dict:
    """Settings of shards already in output_dir: {field: (value, where found)}."""
    found = {}
    manifest_path = os.path.join(output_dir, MANIFEST_NAME)
    if os.path.isfile(manifest_path):
        manifest = load_manifest(output_dir)
        for field in ("format", "seq_length", "vocab_size", "tokenizer_sha256"):
            found[field] = (getattr(manifest, field), MANIFEST_NAME)
        found["prep_key"] = (manifest.info.get("prep_key"), MANIFEST_NAME)
    for name in sorted(os.listdir(output_dir)):
        if name.endswith(".tfrecord.done") and _SHARD_FILE.match(name):
            try:
                with open(os.path.join(output_dir, name)) as file:
                    config = json.load(file).get("config", {})
            except (OSError, json.JSONDecodeError):
                continue
            for field, value in config.items():
                found.setdefault(field, (value, name))
    return found


def refuse_conflicts(output_dir: str, existing: dict, requested: dict, overwrite: bool) -> None:
    """ValueError naming both values if output_dir holds shards made with other settings."""
    if overwrite:
        return
    for field, value in requested.items():
        if field in existing and existing[field][0] != value:
            old, where = existing[field]
            raise ValueError(f"{output_dir} holds shards made with {field}={old!r} (see {where}) but "
                             f"{field}={value!r} was requested; choose another --output_dir or pass --overwrite")


def pieces_key(pieces: list[source_spec.Piece]) -> str:
    return hashlib.sha256(json.dumps([p.key() for p in pieces]).encode()).hexdigest()


def finished_preparation(output_dir: str, key: str, overwrite: bool) -> Manifest | None:
    """The existing manifest if it was made by the same key and all shards check out.

    A manifest made with a different key is refused (unless overwrite); an invalid or
    stale one is removed so no reader trusts it while shards are rewritten.
    """
    path = os.path.join(output_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    manifest = load_manifest(output_dir)
    if manifest.info.get("prep_key") != key and not overwrite:
        raise ValueError(f"{output_dir} already holds data prepared from other input or settings "
                         f"(source {manifest.info.get('source')!r}, shard_size_mb "
                         f"{manifest.info.get('shard_size_mb')}, ...); choose another --output_dir or pass --overwrite")
    if manifest.info.get("prep_key") == key and _shards_intact(manifest):
        logging.info("%s: already prepared and intact; nothing to do", output_dir)
        return manifest
    os.remove(path)
    return None


def _shards_intact(manifest: Manifest) -> bool:
    for split in manifest.splits.values():
        for shard in split.shards:
            path = os.path.join(manifest.data_dir, shard.file)
            if not os.path.isfile(path) or shards.file_sha256(path) != shard.sha256:
                logging.warning("%s is missing or damaged; writing it again", path)
                return False
    return True


def remove_stale_files(output_dir: str, manifest: Manifest) -> None:
    """Delete shard files (and sidecars, temps) of older runs that the new manifest does not list."""
    keep = {shard.file for split in manifest.splits.values() for shard in split.shards}
    for name in os.listdir(output_dir):
        match = _SHARD_FILE.match(name)
        if not match:
            continue
        if match["suffix"] == ".tmp" or name.removesuffix(match["suffix"] or "") not in keep:
            os.remove(os.path.join(output_dir, name))
