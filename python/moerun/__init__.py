"""moerun from Python: a client of a running job's serving protocol, a drop-in PyTorch MoE
module, and the MoE layer computed in-process by moerun's CPU kernels.

    import moerun
    with moerun.Client("127.0.0.1:7000") as c:        # a running `moerun serve`
        y = c.infer(x)                                 # numpy / torch, f32 or bf16, [..., hidden]
    layer = moerun.Layer("tests/data/hf-moe/mixtral")  # the same layer in this process
    y2 = layer.forward(x)                              # bitwise y

Modules: moerun.client (Client), moerun.aio (AsyncClient), moerun.errors (the server's error
codes as exceptions), moerun.torch (RemoteMoE, LocalMoE, replace_moe_blocks, save_moe_checkpoint),
moerun.ctl (what moectl answers), moerun.job (LocalJob: a local `moerun serve`), moerun.bench,
moerun.safetensors_io (read and write safetensors files).
"""

import pkgutil as _pkgutil

# The package is split in two folders: the sources (python/moerun) and what the build makes
# (build/python/moerun: the protobuf classes in moerun.v1 and the compiled moerun._layer). Both
# are searched, whichever comes first on sys.path.
__path__ = _pkgutil.extend_path(__path__, __name__)

__version__ = "0.1.0"

from moerun.errors import (  # noqa: E402
    DeadlineExceededError,
    FrameTimeoutError,
    FrameTooLargeError,
    InternalError,
    InvalidArgumentError,
    MalformedFrameError,
    MoerunError,
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
)
from moerun.client import Client  # noqa: E402
from moerun.aio import AsyncClient  # noqa: E402

try:
    from moerun._layer import Layer  # noqa: E402
except ImportError as _e:  # built by CMake (the README's set-up) or `pip install ./python`
    _layer_error = _e

    class Layer:  # type: ignore[no-redef]
        """Placeholder: the compiled module moerun._layer was not found."""

        def __init__(self, *args, **kwargs):
            raise ImportError(
                "moerun.Layer needs the compiled module moerun._layer, which this installation "
                "lacks (build moerun with CMake, then put build/python on PYTHONPATH, or "
                f"`pip install ./python` after the build): {_layer_error}"
            )

__all__ = [
    "AsyncClient",
    "Client",
    "DeadlineExceededError",
    "FrameTimeoutError",
    "FrameTooLargeError",
    "InternalError",
    "InvalidArgumentError",
    "Layer",
    "MalformedFrameError",
    "MoerunError",
    "OverloadedError",
    "UnauthenticatedError",
    "UnavailableError",
]
