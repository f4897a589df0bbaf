"""torch.save's zip, checked before torch.load inflates anything: stored entries only, no more bytes than written.

torch.save writes a zip of stored (uncompressed) entries: data.pkl, the tensors' storages, a few tags.
torch.load also reads deflated entries, and allocates an entry's declared size before it looks at it: a
300 KB file whose storage inflates to 300 MB takes 300 MB (measured, torch 2.13; deflate reaches ~1000:1).
So every torch zip read from a checkpoint (each rank's RNG state, each item DCP stored in a shard) is first
checked here from its central directory alone, a few small reads: every entry stored, its stored and
declared sizes equal, all of them inside the bytes it was given, at most MAX_ENTRIES of them.
"""

from __future__ import annotations

import io
import zipfile
from typing import BinaryIO

MAX_ENTRIES = 4096  # data.pkl, version tags, one entry per storage: a tensor item has one, an RNG file a few


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of `f`, as a file of its own (what zipfile reads the directory from)."""

    def __init__(self, f: BinaryIO, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def check(f: BinaryIO, offset: int = 0, length: int | None = None) -> None:
    """ValueError (why) unless bytes [offset, offset + length) of `f` (to its end when None) are a zip that
    torch.load can read without inflating: stored entries only, their sizes within `length`."""
    if length is None:
        length = f.seek(0, io.SEEK_END) - offset
    try:
        entries = zipfile.ZipFile(_Slice(f, offset, length)).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise ValueError(f"not a torch.save zip ({str(err)[:80] or type(err).__name__})") from None
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"a torch.save zip of {len(entries):,} entries (torch writes a few per tensor)")
    total = 0
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise ValueError(f"a compressed zip entry ({entry.file_size:,} bytes inflated; torch.save stores them)")
        total += entry.file_size
    if total > length:
        raise ValueError(f"zip entries of {total:,} bytes in {length:,}")


def check_bytes(data: bytes) -> None:
    check(io.BytesIO(data))
