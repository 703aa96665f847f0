"""Plain or gzip text files read in blocks up to a damaged gzip stream, and :func:`count_lines`
(re-exported by :mod:`comera_rec.data.readers`)."""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import List, Optional, Tuple

from comera_rec.data.reader_base import BadInputError

# what a damaged gzip stream raises on read: truncated (EOFError), corrupt deflate data
# (zlib.error), a bad header or CRC (gzip.BadGzipFile)
GZIP_STREAM_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


def open_binary(path: Path) -> io.BufferedIOBase:
    """Open plain or gzip (detected by magic bytes) for binary reading."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def read_block(f: io.BufferedIOBase, size: int) -> Tuple[bytes, Optional[Exception]]:
    """Up to ``size`` bytes, and the error of a damaged gzip stream if reading stopped on one.

    Reads with ``read1`` so that the bytes decompressed before the damage are returned,
    not lost with the exception (``read(size)`` drops what it had gathered).
    """
    parts: List[bytes] = []
    n = 0
    while n < size:
        try:
            part = f.read1(size - n)
        except GZIP_STREAM_ERRORS as e:
            return b"".join(parts), e
        if not part:
            break
        parts.append(part)
        n += len(part)
    return b"".join(parts), None


def compressed_pos(f: io.BufferedIOBase, path: Path) -> str:
    """ "near byte X of Y (compressed)" for a gzip file, for messages about its damage."""
    try:
        return f" near compressed byte {f.fileobj.tell()} of {path.stat().st_size}"  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return ""


def damage_message(path: Path, lines: int, pos: str, err: Exception) -> str:
    """The message for a gzip stream damaged after ``lines`` whole lines (``pos``: from :func:`compressed_pos`)."""
    return (
        f"{path}: damaged gzip stream after line {lines}{pos}: {type(err).__name__}: {err} "
        f"(truncated or corrupt file; the {lines} whole lines before the damage are readable)"
    )


def count_lines_with_damage(path: Path, block_bytes: int) -> Tuple[int, Optional[str]]:
    """(lines, message of a damaged gzip stream or None); with damage, whole lines before it."""
    n, last = 0, b"\n"
    with open_binary(path) as f:
        while True:
            block, err = read_block(f, block_bytes)
            n += block.count(b"\n")
            if block:
                last = block[-1:]
            if err is not None:
                return n, damage_message(path, n, compressed_pos(f, path), err)
            if not block:
                break
    return n + (last != b"\n"), None


def count_lines(path: str | Path, block_bytes: int = 16 << 20) -> int:
    """Lines in a plain or gzip text file (a last line without newline counts).

    Raises :class:`BadInputError` naming the file if its gzip stream is damaged.

    Example::

        n = count_lines("day_0.gz")
    """
    n, damage = count_lines_with_damage(Path(path), block_bytes)
    if damage is not None:
        raise BadInputError(damage)
    return n
