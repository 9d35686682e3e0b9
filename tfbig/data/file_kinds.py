"""What an input file is, told by its name and the first bytes it holds: text, JSON lines, a
MediaWiki XML dump (recognised by content, whatever its name, compressed or not) or a binary
file that tfbig-prep skips and counts."""
import functools
import os
import re

from tfbig.data import compression
from tfbig.data.source_spec import INPUT_SUFFIXES, WIKI_PART, file_stamp

# A MediaWiki XML export begins so, whatever its file is called (a renamed dump, a sample).
_DUMP_START = re.compile(rb"^(\xef\xbb\xbf)?\s*(<\?xml[^>]*\?>\s*)?(<!--.*?-->\s*)*<mediawiki[\s>]", re.DOTALL)


HEAD_BYTES = 8192  # what is read of each input file to tell a dump or a binary file by content


BINARY_SHARE = 0.3  # a file whose head is more than this share undecodable or control characters is binary


def readable_input(name: str) -> bool:
    """A document file, plain or compressed; x.jsonl.lz4 and the like are refused, not passed over."""
    suffix = os.path.splitext(name)[1].lower()
    if suffix in compression.UNSUPPORTED_SUFFIXES and not name[:-len(suffix)].endswith(INPUT_SUFFIXES):
        return False
    inner = compression.inner_name(name)
    return inner.endswith(INPUT_SUFFIXES) or bool(WIKI_PART.search(inner))


def unnamed_dump(path: str) -> bool:
    """A MediaWiki dump under a name without a known suffix (not one of an unread compression)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in compression.UNSUPPORTED_SUFFIXES:
        return False
    try:
        return is_mediawiki_dump(path)
    except (OSError, ValueError):  # unreadable, or damaged compressed data: not an input asked for
        return False


def file_head(path: str, size: int = HEAD_BYTES) -> bytes:
    """The first `size` bytes of a file's content (decompressed, for a compressed file)."""
    if not compression.compression_suffix(path):
        with open(path, "rb") as file:
            return file.read(size)
    head = b""
    blocks = compression.decompressed_blocks(path)
    for block in blocks:
        head += block
        if len(head) >= size:
            break
    blocks.close()
    return head[:size]


@functools.lru_cache(maxsize=4096)
def _head_of(path: str, stamp: str) -> bytes:
    del stamp  # the cache key: a changed file is read again
    return file_head(path)


def is_mediawiki_dump(path: str) -> bool:
    """Whether the (decompressed) content of `path` starts as a MediaWiki XML export does
    (`<mediawiki`, after an XML declaration), whatever the file is called."""
    return bool(_DUMP_START.match(_head_of(path, file_stamp(path))))


def looks_binary(head: bytes) -> bool:
    """Whether bytes from the start of a file are binary rather than text: a NUL byte, or more
    than BINARY_SHARE of its characters undecodable as UTF-8 or control characters."""
    if b"\x00" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    bad = sum(1 for c in text if c == "\ufffd" or (ord(c) < 32 and c not in "\t\n\r\f\v\x1b"))
    return bad > BINARY_SHARE * max(len(text), 1)


def binary_files(files: list[str]) -> list[str]:
    """The files among `files` that hold binary data (`looks_binary` of their head), which
    tfbig-prep skips: decoded, their bytes would become thousands of rare characters."""
    return [path for path in files if looks_binary(_head_of(path, file_stamp(path)))]
