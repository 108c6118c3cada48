"""Tensors in and out of the serving protocol: numpy arrays and torch tensors, F32 and BF16.

Inputs (``[..., hidden]``: the leading dimensions are flattened into tokens for the request,
and the answer is given back in the input's shape):

========================================  ===========  =========================================
input                                     on the wire  answer
========================================  ===========  =========================================
numpy float32                             F32          numpy float32
numpy float32, ``dtype="bf16"``           BF16         numpy float32 (converted both ways)
numpy uint16 (bf16 bits), ``dtype="bf16"``  BF16       numpy uint16 (bf16 bits)
torch.float32                             F32          torch.float32
torch.bfloat16                            BF16         torch.bfloat16
torch.float32, ``dtype="bf16"``           BF16         torch.float32 (converted both ways)
torch.bfloat16, ``dtype="f32"``           F32          torch.bfloat16 (converted both ways)
========================================  ===========  =========================================

Copies: none for a C-contiguous input sent in its own dtype (the request's data is the input's
own buffer) and none for the answer (a view of the received frame's buffer; torch tensors via
``torch.from_numpy``). A non-contiguous input is made contiguous (one copy); a dtype conversion
is one copy each way; a torch tensor on another device (GPU) is copied to the CPU to be sent and
its answer copied back to that device (those copies are unavoidable over TCP). Tensors that
require grad are detached (no autograd through a remote call). The float32 -> bfloat16
conversion rounds to nearest even and keeps NaN a NaN, bit for bit as the C++ client's
``SetRequestData``.
"""

import sys
from typing import Any, Callable, Optional

import numpy as np

from moerun.errors import InvalidArgumentError, MalformedFrameError

__all__ = ["bf16_bits_to_float32", "float32_to_bf16_bits", "prepare", "Prepared"]

F32 = 1   # moerun.v1.DType
BF16 = 2

_DTYPE_NAMES = {
    None: None,
    "f32": F32, "float32": F32, "F32": F32,
    "bf16": BF16, "bfloat16": BF16, "BF16": BF16,
}


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> their bfloat16 bit patterns (uint16, same shape), rounded to nearest
    even; a NaN stays a (quiet) NaN with its sign and top payload bits, as ``F32ToBf16`` in
    base/dtype.h: ``(u >> 16) | 0x40``. Infinities stay infinities."""
    x = np.ascontiguousarray(x, dtype="<f4")
    u = x.view("<u4")
    out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
           >> np.uint32(16)).astype("<u2")
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype("<u2")
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16 or int16) -> float32 values (exact), same shape."""
    b = np.asarray(bits)
    if b.dtype.itemsize != 2:
        raise InvalidArgumentError(f"bf16 bits must be a 16-bit integer array, not {b.dtype}")
    return (b.view("<u2").astype("<u4") << np.uint32(16)).view("<f4")


class Prepared:
    """An input ready to send: ``payload`` (a C-contiguous little-endian numpy array of the wire
    dtype, whose buffer is the request's data), ``wire_dtype`` (F32 = 1 or BF16 = 2),
    ``tokens``, ``hidden``, and ``restore(data_u8)`` which turns the answer's data (a uint8
    view) into the output."""

    __slots__ = ("payload", "wire_dtype", "tokens", "hidden", "_restore", "_shape")

    def __init__(self, payload: np.ndarray, wire_dtype: int, shape, restore: Callable):
        self.payload = payload
        self.wire_dtype = wire_dtype
        self._shape = tuple(int(d) for d in shape)
        self.hidden = self._shape[-1]
        t = 1
        for d in self._shape[:-1]:
            t *= d
        self.tokens = t
        self._restore = restore

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes

    def restore(self, data: np.ndarray, dtype: int, shape) -> Any:
        """The output from the answer's ``data`` (uint8 view), ``dtype`` and ``shape``."""
        want = [self.tokens, self.hidden]
        if dtype != self.wire_dtype or list(shape) != want:
            raise MalformedFrameError(
                f"the server answered dtype {dtype} shape {list(shape)} to a request of dtype "
                f"{self.wire_dtype} shape {want}")
        elem = 4 if dtype == F32 else 2
        if data is None:
            data = np.empty(0, np.uint8)
        if data.nbytes != self.tokens * self.hidden * elem:
            raise MalformedFrameError(
                f"the server's answer has {data.nbytes} bytes of data, but shape {want} of "
                f"{'F32' if elem == 4 else 'BF16'} needs {self.tokens * self.hidden * elem}")
        wire = data.view("<f4" if elem == 4 else "<u2").reshape(self._shape)
        return self._restore(wire)


def _torch():
    return sys.modules.get("torch")


def _is_torch(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def prepare(x: Any, dtype: Optional[str] = None) -> Prepared:
    """Checks and converts one input (numpy array or torch tensor, ``[..., hidden]``) as the
    module's table says. ``dtype``: ``None`` (the input's own), ``"f32"`` or ``"bf16"``."""
    if dtype not in _DTYPE_NAMES:
        raise InvalidArgumentError(f"dtype must be None, 'f32' or 'bf16', not {dtype!r}")
    want = _DTYPE_NAMES[dtype]
    if _is_torch(x):
        return _prepare_torch(x, want)
    if isinstance(x, np.ndarray):
        return _prepare_numpy(x, want)
    raise TypeError(f"input must be a numpy array or a torch tensor, not {type(x).__name__}")


def _check_shape(shape) -> None:
    if len(shape) == 0:
        raise InvalidArgumentError("input must have shape [..., hidden], not a scalar")


def _prepare_numpy(x: np.ndarray, want: Optional[int]) -> Prepared:
    _check_shape(x.shape)
    kind = x.dtype
    if kind.kind == "f" and kind.itemsize == 4:
        if want == BF16:
            bits = float32_to_bf16_bits(x)
            return Prepared(bits, BF16, x.shape, bf16_bits_to_float32)
        payload = np.ascontiguousarray(x, dtype="<f4")
        return Prepared(payload, F32, x.shape, lambda w: w)
    if kind.kind in "ui" and kind.itemsize == 2:
        if want != BF16:
            raise InvalidArgumentError(
                f"a numpy {kind} input is taken as bfloat16 bits only with dtype='bf16'")
        payload = np.ascontiguousarray(x, dtype=kind.newbyteorder("<")).view("<u2")
        signed = kind.kind == "i"
        return Prepared(payload, BF16, x.shape,
                        (lambda w: w.view("<i2")) if signed else (lambda w: w))
    raise InvalidArgumentError(
        f"numpy inputs must be float32 (or uint16 bfloat16 bits with dtype='bf16'), not "
        f"{kind}: convert with x.astype(np.float32)")


def _prepare_torch(x, want: Optional[int]) -> Prepared:
    torch = _torch()
    _check_shape(tuple(x.shape))
    device = x.device
    shape = tuple(x.shape)
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # over TCP a device tensor is staged in host memory; unavoidable
    t = t.contiguous()

    def back(out):
        return out if device.type == "cpu" else out.to(device)

    if t.dtype == torch.float32:
        arr = t.numpy()
        if want == BF16:
            return Prepared(float32_to_bf16_bits(arr), BF16, shape,
                            lambda w: back(torch.from_numpy(bf16_bits_to_float32(w))))
        return Prepared(arr, F32, shape, lambda w: back(torch.from_numpy(w)))
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().view("<u2")
        if want == F32:
            return Prepared(bf16_bits_to_float32(bits), F32, shape,
                            lambda w: back(torch.from_numpy(
                                float32_to_bf16_bits(w).view("<i2")).view(torch.bfloat16)))
        return Prepared(bits, BF16, shape,
                        lambda w: back(torch.from_numpy(w.view("<i2")).view(torch.bfloat16)))
    raise InvalidArgumentError(
        f"torch inputs must be torch.float32 or torch.bfloat16, not {t.dtype}")
