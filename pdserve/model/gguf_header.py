"""GGUF header reading (llama.cpp format, spec v2/v3, little-endian), without torch.

Layout: magic ``b"GGUF"``, uint32 version, uint64 tensor count, uint64 key/value count; each
key/value is a string key, a uint32 value type and the value (arrays: uint32 element type + uint64
count + elements; strings: uint64 length + bytes); then the tensor table. Arrays are skipped, only
their lengths kept, so a header with a 49k-token vocabulary scans in tens of milliseconds
(``gguf.GGUFReader`` builds numpy views of every element and takes seconds). The tokenizer reads
its metadata here; :mod:`pdserve.model.gguf_file` adds the tensor table and the weights.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.config import ConfigError

# GGUF value type id -> struct format of a fixed-size value (GGUF spec, "gguf_type")
FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
          11: "<q", 12: "<d"}  # fmt: skip
STRING, ARRAY = 8, 9


class Scanner:
    """A cursor over a memory-mapped GGUF file (``off``: bytes from the start)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.off = buf, 0

    def fixed(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.fixed("<Q")
        if self.off + n > len(self.buf):
            raise IndexError(f"string of {n} bytes runs past the end of the file")
        s = self.buf[self.off : self.off + n].decode("utf-8")
        self.off += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        fmt = FIXED.get(vtype)
        if fmt is None:
            raise struct.error(f"unknown GGUF value type {vtype}")
        return self.fixed(fmt)

    def skip_array(self) -> int:
        """Skip an array value; returns its element count."""
        etype, count = self.fixed("<I"), self.fixed("<Q")
        if etype in (STRING, ARRAY):
            for _ in range(count):
                if etype == STRING:
                    self.off += 8 + self.fixed("<Q")
                else:
                    self.skip_array()
        else:
            fmt = FIXED.get(etype)
            if fmt is None:
                raise struct.error(f"unknown GGUF array element type {etype}")
            self.off += count * struct.calcsize(fmt)
        return count


def with_scanner(path: Path, scan: Callable[[Scanner], object]) -> None:
    """Run ``scan`` over the memory-mapped file; ConfigError naming the file on any read error."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as b:
            scan(Scanner(b))
    except (OSError, ValueError, struct.error, IndexError, UnicodeDecodeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            f"{path} is not a readable GGUF file (truncated or corrupt): {e}"
        ) from None


def scan_metadata(
    s: Scanner, path: Path, metadata: dict[str, Any], array_lengths: dict[str, int]
) -> int:
    """Read the header and key/value section into ``metadata`` (scalars) and ``array_lengths``
    (arrays are skipped, not parsed); returns the tensor count. The scanner is left at the
    tensor table."""
    if s.buf[:4] != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file (bad magic {bytes(s.buf[:4])!r})")
    s.off = 4
    version = s.fixed("<I")
    if version not in (2, 3):
        raise ConfigError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = s.fixed("<Q"), s.fixed("<Q")
    for _ in range(n_kv):
        key = s.string()
        vtype = s.fixed("<I")
        if vtype == ARRAY:
            array_lengths[key] = s.skip_array()
        else:
            metadata[key] = s.value(vtype)
    return int(n_tensors)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All scalar (non-array) metadata of a GGUF file, key -> value, in tens of milliseconds
    (``gguf.GGUFReader`` parses every vocabulary entry and takes seconds). Any architecture.

    Raises ConfigError naming the file when it is missing, not GGUF v2/v3, truncated or corrupt.
    """
    p = Path(path)
    metadata: dict[str, Any] = {}
    with_scanner(p, lambda s: scan_metadata(s, p, metadata, {}))
    return metadata
