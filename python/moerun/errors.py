"""The serving protocol's error codes (``moerun.v1.ErrorCode``) as Python exceptions.

Every error this package raises is a :class:`MoerunError`. Its subclasses match the codes of
``runtime/proto/moerun/v1/serving.proto`` and also derive from the builtin exception that fits, so that
generic handlers work too::

    try:
        y = client.infer(x)
    except moerun.OverloadedError:      # the server's queue is full: back off and retry
        ...
    except TimeoutError:                # DeadlineExceededError (server or client side)
        ...

Attributes of every error:

``code``
    the ErrorCode name, e.g. ``"INVALID_ARGUMENT"``. Errors found on this side (no server, a
    timeout, a bad argument) carry the code that means the same thing.
``message``
    what went wrong: the server's message verbatim when the error came from the server.
``from_server``
    whether the server answered with this error (``False``: found by the client).

``str(e)`` is ``"server: invalid_argument: <message>"`` for the server's errors (as the C++
client's ``StatusFromResponse`` writes them) and the message alone for the client's.
"""

from typing import Dict, Optional, Type

__all__ = [
    "DeadlineExceededError",
    "FrameTimeoutError",
    "FrameTooLargeError",
    "InternalError",
    "InvalidArgumentError",
    "MalformedFrameError",
    "MoerunError",
    "OverloadedError",
    "UnauthenticatedError",
    "UnavailableError",
    "CODE_NAMES",
    "error_from_code",
]

# moerun.v1.ErrorCode, by value (kept here so that this module needs no generated code).
CODE_NAMES: Dict[int, str] = {
    0: "OK",
    1: "INVALID_ARGUMENT",
    2: "DEADLINE_EXCEEDED",
    3: "OVERLOADED",
    4: "UNAVAILABLE",
    5: "FRAME_TOO_LARGE",
    6: "MALFORMED_FRAME",
    7: "FRAME_TIMEOUT",
    8: "UNAUTHENTICATED",
    9: "INTERNAL",
}


class MoerunError(Exception):
    """Base class of every moerun error; see the module's documentation for the attributes.

    Instances of this base class itself are raised only for an error code this client does not
    know (``code`` is then ``"CODE_<n>"``).
    """

    code: str = "INTERNAL"  # overridden by each subclass

    def __init__(self, message: str = "", *, code: Optional[str] = None,
                 from_server: bool = False, request_id: Optional[int] = None):
        """``message``: what went wrong; ``code``: the ErrorCode name (default: the class's);
        ``from_server``: the server answered this error; ``request_id``: the request it answers
        (``None`` when unknown or not tied to one request)."""
        if code is not None:
            self.code = code
        self.message = message
        self.from_server = from_server
        self.request_id = request_id
        super().__init__(message)

    def __str__(self) -> str:
        if self.from_server:
            kind = self.code.lower()
            return f"server: {kind}: {self.message}" if self.message else f"server: {kind}"
        return self.message

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, "
                f"from_server={self.from_server!r})")

    def __reduce__(self):  # picklable (multiprocessing) with its attributes
        return (_rebuild, (type(self), self.message, self.code, self.from_server,
                           self.request_id))


def _rebuild(cls, message, code, from_server, request_id):
    return cls(message, code=code, from_server=from_server, request_id=request_id)


class InvalidArgumentError(MoerunError, ValueError):
    """INVALID_ARGUMENT: the request is well formed but wrong (hidden size, dtype, shape, layer,
    token count, NaN/Inf in the input), or an argument given to this client is."""

    code = "INVALID_ARGUMENT"


class DeadlineExceededError(MoerunError, TimeoutError):
    """DEADLINE_EXCEEDED: the server did not have the answer by the request's ``deadline_ms``
    (``from_server`` true, the server's message), or no answer came within the client's
    ``timeout`` (``from_server`` false). Retrying may succeed."""

    code = "DEADLINE_EXCEEDED"


class OverloadedError(MoerunError):
    """OVERLOADED: a bounded queue or budget of the server is full, or it has too many
    connections. Not retried by the clients: retrying later (with a back-off) is the caller's
    choice, and usually the right one."""

    code = "OVERLOADED"


class UnavailableError(MoerunError, ConnectionError):
    """UNAVAILABLE: no router could be reached (refused, reset, closed: the message names the
    targets tried), an expert rank the request needs does not answer, the server is draining,
    or the client was closed with the call pending."""

    code = "UNAVAILABLE"


class FrameTooLargeError(MoerunError):
    """FRAME_TOO_LARGE: a frame over the limit: the server's answer to a request over its
    ``serving.max_frame_bytes`` (it then closes the connection), a request this client refuses
    to send because it is over its own ``max_frame_bytes``, or an answer announced over that
    limit (refused before its body is read; the connection is dropped)."""

    code = "FRAME_TOO_LARGE"


class MalformedFrameError(MoerunError):
    """MALFORMED_FRAME: the server could not parse a frame of ours, or a frame from the server
    is not a valid message (or does not fit the request: shape, dtype, size)."""

    code = "MALFORMED_FRAME"


class FrameTimeoutError(MoerunError, TimeoutError):
    """FRAME_TIMEOUT: the server saw a frame started but not completed within its
    ``serving.frame_timeout_ms`` and closed the connection."""

    code = "FRAME_TIMEOUT"


class UnauthenticatedError(MoerunError, PermissionError):
    """UNAUTHENTICATED: the control endpoint refused a missing or wrong token."""

    code = "UNAUTHENTICATED"


class InternalError(MoerunError):
    """INTERNAL: a bug in the server (please report it with the message)."""

    code = "INTERNAL"


_BY_CODE: Dict[int, Type[MoerunError]] = {
    1: InvalidArgumentError,
    2: DeadlineExceededError,
    3: OverloadedError,
    4: UnavailableError,
    5: FrameTooLargeError,
    6: MalformedFrameError,
    7: FrameTimeoutError,
    8: UnauthenticatedError,
    9: InternalError,
}


def error_from_code(code: int, message: str, *, request_id: Optional[int] = None) -> MoerunError:
    """The exception for a server's answer with ErrorCode ``code`` (an int, not OK) and its
    ``message``: e.g. ``error_from_code(1, "wrong hidden size")`` is an
    :class:`InvalidArgumentError` whose ``str`` is
    ``"server: invalid_argument: wrong hidden size"``. An unknown code gives a plain
    :class:`MoerunError` with code ``"CODE_<n>"``. Raises ``ValueError`` for OK (0)."""
    code = int(code)
    if code == 0:
        raise ValueError("error_from_code: code 0 is OK, not an error")
    cls = _BY_CODE.get(code)
    if cls is None:
        return MoerunError(message, code=f"CODE_{code}", from_server=True, request_id=request_id)
    return cls(message, from_server=True, request_id=request_id)
