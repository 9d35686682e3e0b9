"""Compressed inputs, streamed: `.gz`, `.bz2`, `.xz` and `.zst` files read without ever
writing the decompressed text to disk.

A piece of a compressed file is the **whole file**: none of these formats can be entered at
an arbitrary byte, so one worker decompresses one file from its start (several files are
read by several workers). Concatenated members, streams and frames (`cat a.gz b.gz`,
multistream bz2 such as Wikipedia's dumps, multi-frame zstd) are read one after another.

Damage is reported, never silently cut short: a file that ends inside a member/stream/frame
raises ValueError naming the file and the byte where it ends (and where the last complete
frame ended); undecodable data names the file and the block of bytes it was found in.

Example:
    with open_text_stream("pile/00.jsonl.zst") as lines:
        for line in lines:  # bytes, decompressed on the fly
            ...
"""

import bz2
import dataclasses
import io
import lzma
import os
import zlib
from collections.abc import Callable, Iterator

READ_BYTES = 256 << 10  # compressed bytes read at a time
RATIO_SAMPLE_BYTES = 1 << 20  # compressed bytes decompressed to estimate a file's text size
# Suffixes that say "compressed" in a format this module does not read: refused, not read as text.
UNSUPPORTED_SUFFIXES = (".lz4", ".lzma", ".lz", ".zip", ".7z", ".z", ".br", ".sz", ".snappy", ".tar", ".tgz",
                        ".zstd", ".bz", ".gzip", ".rar")


@dataclasses.dataclass(frozen=True)
class Codec:
    """One compression format: its name and a factory of incremental decoders.

    A decoder has `decompress(bytes) -> bytes`, `eof` (the member/stream/frame ended) and
    `unused_data` (bytes after that end: the next member/stream/frame).
    """

    name: str
    unit: str  # what one independently decodable part is called
    new_decoder: Callable[[], object]
    errors: tuple[type[BaseException], ...]


def _zstd_decoder():
    import zstandard  # imported only when a .zst file is read

    return zstandard.ZstdDecompressor().decompressobj()


def _zstd_errors() -> tuple[type[BaseException], ...]:
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


CODECS = {
    ".gz": Codec("gzip", "member", lambda: zlib.decompressobj(wbits=31), (zlib.error,)),
    ".bz2": Codec("bzip2", "stream", bz2.BZ2Decompressor, (OSError, ValueError)),
    ".xz": Codec("xz", "stream", lzma.LZMADecompressor, (lzma.LZMAError,)),
    ".zst": Codec("zstd", "frame", _zstd_decoder, _zstd_errors()),
}


def compression_suffix(path: str) -> str:
    """'.zst' for x.jsonl.zst, '' for an uncompressed file; ValueError for a compressed
    format that is not read (naming the ones that are)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in CODECS:
        return suffix
    if suffix in UNSUPPORTED_SUFFIXES:
        raise ValueError(f"{path}: unknown compression suffix {suffix!r}; expected one of "
                         f"{', '.join(sorted(CODECS))} (or an uncompressed file); recompress it, e.g. "
                         f"to zstd: zstd {os.path.basename(path)[:-len(suffix)]}")
    return ""


def inner_name(path: str) -> str:
    """The file name without its compression suffix: 'x.jsonl' for 'x.jsonl.zst'."""
    suffix = compression_suffix(path)
    return path[:-len(suffix)] if suffix else path


def decompressed_blocks(path: str) -> Iterator[bytes]:
    """The decompressed content of `path`, block by block (never all in memory)."""
    codec = CODECS[compression_suffix(path)]
    with open(path, "rb") as file:
        decoder, started, unit_start, offset = codec.new_decoder(), False, 0, 0
        while block := file.read(READ_BYTES):
            data = block
            while data:
                try:
                    out = decoder.decompress(data)
                except codec.errors + (EOFError,) as error:
                    raise ValueError(f"{path}: corrupt {codec.name} data in bytes [{offset}, {offset + len(block)}) "
                                     f"({error}); the file is damaged: fetch it again") from error
                started = True
                if out:
                    yield out
                if not decoder.eof:
                    break
                data = decoder.unused_data  # the next member/stream/frame starts here
                unit_start = offset + len(block) - len(data)
                decoder, started = codec.new_decoder(), False
            offset += len(block)
        if started:
            raise ValueError(f"{path}: truncated: the file ends at byte {offset}, inside a {codec.name} "
                             f"{codec.unit} that starts at byte {unit_start} (the data before it is intact); "
                             "the download or copy was cut short: fetch it again")


class _BlockReader(io.RawIOBase):
    """A readable raw stream over an iterator of byte blocks (so io.BufferedReader gives readline)."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks, self._pending = blocks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            self._pending = next(self._blocks, b"")
            if not self._pending:
                return 0
        count = min(len(buffer), len(self._pending))
        buffer[:count], self._pending = self._pending[:count], self._pending[count:]
        return count


def open_stream(path: str) -> io.BufferedReader:
    """A binary file object of the decompressed content (iterate it for lines)."""
    return io.BufferedReader(_BlockReader(decompressed_blocks(path)), buffer_size=READ_BYTES)


def estimated_size(path: str) -> int:
    """Decompressed bytes of `path`, estimated from its first RATIO_SAMPLE_BYTES (shard planning
    only: a compressed file is one piece, so this only sizes the shard it lands in)."""
    size = os.path.getsize(path)
    codec, out = CODECS[compression_suffix(path)], 0
    with open(path, "rb") as file:
        sample = file.read(RATIO_SAMPLE_BYTES)
    decoder, data = codec.new_decoder(), sample
    try:
        while data:
            out += len(decoder.decompress(data))
            data = decoder.unused_data if decoder.eof else b""
            if data:
                decoder = codec.new_decoder()
    except codec.errors + (EOFError,) as error:
        raise ValueError(f"{path}: corrupt {codec.name} data in bytes [0, {len(sample)}) ({error}); the file is "
                         "damaged: fetch it again") from error
    return int(out * size / max(len(sample), 1))
