"""The project's own exception hierarchy.

Foreign exceptions (msgspec, tomllib, NCCL, huggingface_hub, torch) are translated into
these once, at the edge; inner code and the HTTP layer see only these.
"""

from __future__ import annotations

# sysexits(3) codes of the CLI contract (docs/DESIGN.md).
EX_OK = 0
EX_USAGE = 64
EX_UNAVAILABLE = 69  # a default model cannot be loaded
EX_SOFTWARE = 70  # the deadman: a wedge that could not be recovered
EX_OSERR = 71  # the listener could not be bound (address in use, permission)
EX_CONFIG = 78


class NeuronError(Exception):
    """Base of every error neuron raises on purpose."""


class ConfigError(NeuronError):
    """Raised by config loading if the file, a key or an environment override is invalid.

    The message names the file and the key (or the line, for invalid TOML).
    """

    exit_code = EX_CONFIG


class ModelLoadError(NeuronError):
    """Raised by model loading if a model cannot be read, placed or built."""

    exit_code = EX_UNAVAILABLE


class ModelFileError(ModelLoadError):
    """Raised by the GGUF reader if the file is not a model neuron can use: corrupt, hostile
    (a count beyond what the file can hold), or unsupported. The HTTP layer answers 422."""


class UnsupportedModelError(ModelFileError):
    """Raised by the GGUF reader if the file's architecture or a tensor type is not supported."""


class SourceError(ModelLoadError):
    """Raised by source resolution if a model source cannot be fetched or is not allowed."""


class PlacementError(ModelLoadError):
    """Raised by placement if no device (set) can hold the model; the message has the numbers."""


class ApiError(NeuronError):
    """Base of the errors that become an API error response: `status`, OpenAI's error
    `type`, the message, and the `param` and `code` it names.

    RequestError (4xx: the request is wrong) and UnavailableError (503: the node cannot take
    it now) are its kinds; the HTTP layer turns any of them into its response.
    """

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class RequestError(ApiError):
    """Raised for a request that is wrong: becomes a 4xx naming the offending field."""

    status = 400
    error_type = "invalid_request_error"


class ContextLengthError(RequestError):
    """Raised if a prompt plus its max tokens do not fit a slot's context."""

    def __init__(self, message: str, *, param: str | None = "max_tokens"):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFoundError(RequestError):
    """Raised if a request names a model that is not loaded."""

    status = 404

    def __init__(self, name: str):
        super().__init__(f"model {name!r} is not loaded", param="model", code="model_not_found")


class TooManyModelsError(RequestError):
    """Raised by a runtime load if `node.max_models` models are already loaded (409)."""

    status = 409

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"{limit} models are loaded, the most this node holds (node.max_models); "
            "unload one first",
            code="too_many_models",
        )


class ModelExistsError(RequestError):
    """Raised by `load_model` if a model of that name is loaded or loading (409)."""

    status = 409

    def __init__(self, name: str) -> None:
        super().__init__(
            f"a model named {name!r} is already loaded (or loading); unload it first",
            param="name",
            code="model_exists",
        )


class QueueFullError(RequestError):
    """Raised if a model's queue already holds `max_queue` waiting requests (429)."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message, code="queue_full")
        self.retry_after_s = retry_after_s


class UnavailableError(ApiError):
    """Raised if the node or the model cannot take work now: draining, recovering, wedged (503)."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, code: str = "unavailable", retry_after_s: int = 5):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class CommError(NeuronError):
    """Raised by a communicator if a collective, init, abort or destroy failed."""


class CommAbortedError(CommError):
    """Raised by a collective if its communicator was aborted while it waited."""


class NcclError(CommError):
    """Raised by the NCCL binding if a call returned a non-zero ncclResult_t."""

    def __init__(self, call: str, code: int, error_string: str, last_error: str = ""):
        detail = f"{call} failed: ncclResult_t {code} ({error_string})"
        if last_error:
            detail += f": {last_error}"
        super().__init__(detail)
        self.call = call
        self.code = code
        self.error_string = error_string
        self.last_error = last_error


class FailpointError(NeuronError):
    """Raised at a failpoint whose action is `error` (fault injection, NEURON_FAILPOINTS)."""


class StepTimeoutError(NeuronError):
    """Raised if an engine step ran past `watchdog.step_timeout_s`: the model is wedged."""
