"""Read the scalar key/value metadata at the head of a GGUF file, fast.

The tokenizer needs a few scalars (``tokenizer.ggml.eos_token_id``, ``eot_token_id``,
``eom_token_id``) that transformers' GGUF tokenizer conversion does not expose. ``gguf.GGUFReader``
would do, but it builds numpy views of every array element (the 49k-entry vocabulary and the merges
list) and takes seconds; this scanner skips arrays and parses only what it returns (tens of ms).

Layout (GGUF spec, versions 2 and 3, little-endian): ``b"GGUF"``, uint32 version, uint64 tensor
count, uint64 key/value count, then per key: a string key (uint64 byte length + UTF-8 bytes), a
uint32 value type, the value. Arrays are uint32 element type + uint64 count + elements; strings are
uint64 length + bytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from pdserve.config import ConfigError

# GGUF value type id -> struct format of a fixed-size scalar (GGUF spec, "gguf_type").
_FIXED: dict[int, str] = {
    0: "<B",  # uint8
    1: "<b",  # int8
    2: "<H",  # uint16
    3: "<h",  # int16
    4: "<I",  # uint32
    5: "<i",  # int32
    6: "<f",  # float32
    7: "<?",  # bool
    10: "<Q",  # uint64
    11: "<q",  # int64
    12: "<d",  # float64
}
_STRING = 8
_ARRAY = 9

Scalar = int | float | bool | str


def read_gguf_scalars(path: str | Path) -> dict[str, Scalar]:
    """All non-array metadata of a GGUF file, key -> value (arrays are skipped).

    Raises ConfigError naming the file when it is not a GGUF v2/v3 file or is truncated.
    """
    p = Path(path)
    try:
        with p.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, p)
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot read GGUF metadata of {p}: {e}") from e


def _parse(buf: mmap.mmap, path: Path) -> dict[str, Scalar]:
    if buf[:4] != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ConfigError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    _num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
    off = 24
    out: dict[str, Scalar] = {}
    try:
        for _ in range(num_kv):
            key, off = _read_str(buf, off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            if vtype == _ARRAY:
                off = _skip_array(buf, off)
                continue
            value, off = _read_scalar(buf, off, vtype)
            out[key] = value
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: truncated or corrupt GGUF metadata ({e})") from e
    return out


def _read_str(buf: mmap.mmap, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    off += 8
    if off + n > len(buf):
        raise IndexError(f"string of {n} bytes runs past the end of the file")
    return buf[off : off + n].decode("utf-8"), off + n


def _read_scalar(buf: mmap.mmap, off: int, vtype: int) -> tuple[Scalar, int]:
    if vtype == _STRING:
        return _read_str(buf, off)
    fmt = _FIXED.get(vtype)
    if fmt is None:
        raise struct.error(f"unknown GGUF value type {vtype}")
    (value,) = struct.unpack_from(fmt, buf, off)
    return value, off + struct.calcsize(fmt)


def _skip_array(buf: mmap.mmap, off: int) -> int:
    etype, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if etype == _STRING:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, off)
            off += 8 + n
        return off
    if etype == _ARRAY:
        for _ in range(count):
            off = _skip_array(buf, off)
        return off
    fmt = _FIXED.get(etype)
    if fmt is None:
        raise struct.error(f"unknown GGUF array element type {etype}")
    return off + count * struct.calcsize(fmt)
