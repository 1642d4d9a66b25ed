"""The exception raised for every non-success status of libmoeblaze."""

__all__ = ["MoEBlazeError", "BindingError"]


class MoEBlazeError(RuntimeError):
    """A libmoeblaze call returned a status other than MOEBLAZE_STATUS_SUCCESS.

    Attributes:
        status: the raw integer status (possibly a value this binding does not know).
        function: the C function that failed, e.g. ``"moeblaze_create"``.
        message: the thread-local detail from ``moeblaze_get_last_error_message()``, copied
            immediately after the failing call on the same thread.
        status_name: ``moeblaze_status_name(status)``, e.g.
            ``"MOEBLAZE_STATUS_INVALID_ARGUMENT"`` (``"MOEBLAZE_STATUS_UNKNOWN"`` for unknown).
    """

    def __init__(self, status, function, message, status_name=None):
        self.status = int(status)
        self.function = function
        self.message = message
        if status_name is None:
            from ._types import Status
            status_name = Status.c_name(self.status)
        self.status_name = status_name
        super().__init__("%s failed with %s (%d): %s" % (function, status_name, self.status,
                                                          message or "(no message)"))

    def __reduce__(self):  # picklable across processes
        return (type(self), (self.status, self.function, self.message, self.status_name))


class BindingError(MoEBlazeError, ValueError):
    """A problem the Python binding detects before calling the library (bad buffer size,
    unknown keyword, ABI mismatch). ``status`` is MOEBLAZE_STATUS_INVALID_ARGUMENT or
    MOEBLAZE_STATUS_VERSION_MISMATCH; ``function`` names the Python API."""
