"""Exceptions that carry a message meant for the user.

Everything jaxserve raises on bad input derives from `JaxserveError`, so the CLI can print one line and exit 2 and
the server can turn it into OpenAI error JSON, while genuine bugs still surface as tracebacks.
"""


class JaxserveError(Exception):
    """Base class of every error caused by user input or user-supplied files."""


class ModelLoadError(JaxserveError):
    """The model folder, its config, or its checkpoint files are missing, corrupt or unsupported."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is valid but describes an architecture or option jaxserve does not implement."""


class TokenizerError(JaxserveError):
    """The tokenizer files are missing or unreadable, or a chat template failed to render."""


class InvalidRequestError(JaxserveError):
    """A prompt or a sampling parameter is out of range. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # name of the request field at fault, as in OpenAI's error JSON


class ConfigError(JaxserveError):
    """A settings file or flag is unknown or has a value of the wrong kind."""


class EngineStepError(Exception):
    """A step of the engine failed while running the request; the server answers 500 and keeps serving."""


class EngineDeadError(Exception):
    """The engine thread is gone (failed or shutting down): nothing more can run; the server answers 503."""
