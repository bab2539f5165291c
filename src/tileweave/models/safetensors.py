"""A reader of the safetensors format that reads only the slices asked for, with no dependency beyond
numpy and torch.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (per tensor: ``dtype``,
``shape``, ``data_offsets [begin, end)`` relative to the end of the header; an optional
``__metadata__``), then the tensors' raw little-endian bytes, row-major. A tensor is mapped from the
file (``numpy.memmap``), never read whole: a slice along axis 0 reads only its rows, one along another
axis only the pages that hold its columns. A checkpoint is one ``model.safetensors`` or shards listed
by ``model.safetensors.index.json`` (``weight_map``: tensor name -> file).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import torch

# dtype name -> (numpy dtype of the raw bytes, torch dtype of the tensor); bf16 and fp8 have no numpy
# dtype: their bytes are read as unsigned integers of the same width and viewed as the torch dtype.
DTYPES = {
    "F64": ("<f8", torch.float64), "F32": ("<f4", torch.float32), "F16": ("<f2", torch.float16),
    "BF16": ("<u2", torch.bfloat16), "I64": ("<i8", torch.int64), "I32": ("<i4", torch.int32),
    "I16": ("<i2", torch.int16), "I8": ("i1", torch.int8), "U8": ("u1", torch.uint8), "BOOL": ("?", torch.bool),
    "F8_E4M3": ("u1", torch.float8_e4m3fn), "F8_E5M2": ("u1", torch.float8_e5m2),
}
# A header longer than this is not a safetensors header (the format's reference reader caps it at 100 MB).
MAX_HEADER = 100_000_000



def parse_json(data: bytes | str, what: str):
    """``data`` parsed as JSON; a ``ValueError`` naming ``what`` (the file and part) and where the text
    stops being JSON otherwise."""
    try:
        return json.loads(data)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 text (byte {exc.start}): a corrupted or truncated file?") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): a "
                         "corrupted or truncated file?") from None


def read_json(path: Path):
    """The JSON file at ``path``, parsed; errors name the file (``parse_json``)."""
    return parse_json(Path(path).read_bytes(), str(path))

class SafetensorsFile:
    """The tensors of one ``.safetensors`` file: ``names``, ``shape(name)``, ``dtype(name)`` and
    ``read(name, dim, start, stop)`` (a slice along one axis, copied into a new tensor)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise ValueError(f"{self.path}: not a safetensors file (header length {n}, file size {size})")
            header = parse_json(f.read(n), f"{self.path}: the safetensors header")
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: the safetensors header is not a JSON object")
        self._data_start = 8 + n
        header.pop("__metadata__", None)
        self._entries = header
        for name, entry in header.items():
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if dtype not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {dtype}, which this reader does not "
                                 f"know (known: {', '.join(DTYPES)})")
            itemsize = np.dtype(DTYPES[dtype][0]).itemsize
            if end - begin != math.prod(shape) * itemsize or self._data_start + end > size:
                raise ValueError(f"{self.path}: tensor {name!r} ({dtype} {shape}) has data_offsets "
                                 f"{[begin, end]} that do not fit its size or the file")

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entries[name]["dtype"]][1]

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Elements ``start:stop`` along axis ``dim`` of tensor ``name`` (None: the whole axis)."""
        entry = self._entries[name]
        raw, dtype = DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        index = [slice(None)] * len(shape)
        if shape:
            index[dim] = slice(start, stop)
        count = math.prod(shape)
        if count == 0:  # numpy cannot map zero bytes
            return torch.empty(shape, dtype=dtype)[tuple(index)].clone()
        mapped = np.memmap(self.path, dtype=np.dtype(raw), mode="r",
                           offset=self._data_start + entry["data_offsets"][0], shape=(count,))
        out = torch.from_numpy(np.array(mapped.reshape(shape)[tuple(index)], copy=True))  # the slice only
        return out.view(dtype) if out.dtype != dtype else out


class Checkpoint:
    """The tensors of a checkpoint directory: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` lists. ``names``, ``shape(name)``, ``dtype(name)``, ``read(name, dim,
    start, stop)`` as :class:`SafetensorsFile`; each file's header is read once, its data only on request."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
        if index.exists():
            index_json = read_json(index)
            weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no \"weight_map\" object of tensor names to file names")
            files = {f: SafetensorsFile(directory / f) for f in sorted(set(weight_map.values()))}
            self._where = {name: files[f] for name, f in weight_map.items()}
            for f in files.values():
                missing = [n for n in f.names if n not in self._where]
                if missing:
                    raise ValueError(f"{f.path}: tensors {missing[:4]} are not in {index.name}'s weight_map")
            for name, f in self._where.items():
                if name not in f._entries:
                    raise ValueError(f"{index.name} maps {name!r} to {f.path.name}, which does not hold it")
        elif single.exists():
            f = SafetensorsFile(single)
            self._where = {name: f for name in f.names}
        else:
            raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name].dtype(name)

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return self._where[name].read(name, dim, start, stop)
