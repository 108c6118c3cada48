"""A small safetensors reader and writer (numpy only, no `safetensors` package): the tests' inputs
and outputs of `moerun forward`, and the checkpoints `moerun.torch.save_moe_checkpoint` writes.

The format: an 8-byte little-endian header length, that many bytes of JSON (each tensor's dtype,
shape and [begin, end) byte offsets into the data; optional "__metadata__" of strings), then the
raw little-endian data.

    write_tensors(path, {"input": x})            # x: numpy float32 (F16, I32, U8 ... too)
    write_tensors(path, {"w": bits}, dtypes={"w": "BF16"})  # raw bits of a type numpy lacks
    read_tensors(path) -> {"input": array, ...}  # fresh, writable arrays
    read_metadata(path) -> {"producer": ...}
"""

import json
import os
import struct

import numpy as np

# safetensors dtype <-> numpy (little-endian). BF16 and the FP8/FP4 codes have no numpy type: they
# are written from arrays of their raw bits (write_tensors' dtypes) and not read here.
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _read_header(f, path):
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    header = json.loads(f.read(n))
    return header, 8 + n


def read_tensors(path):
    """Every tensor of the file as a numpy array (name -> array)."""
    with open(path, "rb") as f:
        header, base = _read_header(f, path)
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} is {info['dtype']}, which this reader "
                             f"does not read (it reads {', '.join(_DTYPES)})")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or end > len(data):
            raise ValueError(f"{path}: tensor {name!r} has offsets {begin}..{end}, which do not "
                             f"match shape {list(shape)} in {info['dtype']}")
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=begin).reshape(shape)
        out[name] = arr.astype(dtype.newbyteorder("="), copy=True)
    return out


def read_metadata(path):
    """The file's "__metadata__" (string -> string), {} when it has none."""
    with open(path, "rb") as f:
        header, _ = _read_header(f, path)
    return dict(header.get("__metadata__", {}))


# Codes written from raw bits (write_tensors' dtypes), with their size in bytes.
_RAW_SIZES = {"BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def write_tensors(path, tensors, metadata=None, dtypes=None):
    """Writes name -> numpy array (C order, little-endian) with optional string metadata.

    dtypes: name -> safetensors dtype code for arrays that hold the raw bits of a type numpy
    lacks ("BF16" from uint16/int16 bits, "F8_E4M3"/"F8_E5M2" from uint8). The file is written
    beside its final name and renamed into place, so that a process that has the old file mapped
    (a serving job) keeps reading the old bytes."""
    dtypes = dict(dtypes or {})
    unknown = sorted(set(dtypes) - set(tensors))
    if unknown:
        raise ValueError(f"dtypes names tensors that are not written: {', '.join(unknown)}")
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder not in ("|",) else arr.dtype
        if name in dtypes:
            key = dtypes[name]
            if _RAW_SIZES.get(key) != dtype.itemsize or dtype.kind not in "iu":
                raise ValueError(f"tensor {name!r}: {key} is written from integer arrays of "
                                 f"{_RAW_SIZES.get(key, '?')} byte(s) holding its bits, "
                                 f"not {arr.dtype}")
        else:
            key = _NAMES.get(np.dtype(dtype))
        if key is None:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors name here")
        blob = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        header[name] = {"dtype": key, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
