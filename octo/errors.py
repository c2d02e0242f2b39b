"""Errors with an HTTP status and an OpenAI-shaped body: ``{"error": {message, type, param, code}}``.

Raise these anywhere (engines included); the server's error middleware turns them into JSON.
"""

from __future__ import annotations


class OctoError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class InvalidRequest(OctoError):
    status = 400
    type = "invalid_request_error"


class UnsupportedParameter(InvalidRequest):
    """A parameter the serving engine cannot honour: never silently dropped."""

    code = "unsupported_parameter"

    def __init__(self, param: str, why: str = "") -> None:
        super().__init__(f"Parameter '{param}' is not supported{': ' + why if why else ''}.", param=param)


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(OctoError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(OctoError):
    """A request this server must not answer (a non-local Host on a loopback bind, a web page of another origin)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(OctoError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(OctoError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(OctoError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RequestTimeout(OctoError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Overloaded(OctoError):
    status = 503
    type = "server_overloaded"
    code = "queue_full"


class QueueTimeout(OctoError):
    status = 504
    type = "timeout_error"
    code = "queue_timeout"


class EngineError(OctoError):
    """The engine failed while serving a request."""

    status = 500
    type = "server_error"
    code = "engine_error"


class KVCacheFull(EngineError):
    """Raised by ``Engine.step`` when a KV pool shared by the sequences had no room for the step and nothing was
    consumed (the scheduler preempts a sequence and runs the step again; the client never sees it)."""

    code = "kv_cache_full"


class EngineCrashed(OctoError):
    """The worker process running the model died (a signal, the OOM killer, an exit): its requests end."""

    status = 502
    type = "server_error"
    code = "engine_crashed"


class ModelFailed(OctoError):
    """The model crashed again right after a restart (or could not restart): refused at once, not retried."""

    status = 503
    type = "server_error"
    code = "model_failed"


class ConfigError(OctoError):
    """Bad start-up configuration: unknown engine option, unloadable artifact, bad catalog entry."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_config"
