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


class ConstraintFailedError(InvalidRequestError):
    """A request's output constraint reached a state its grammar cannot go on from (a grammar with no finite string,
    or one too complex for the grammar engine); the request ends with this error instead of a truncated output."""


class ModelNotFoundError(InvalidRequestError):
    """A request names a model (or LoRA adapter) the engine does not serve; the server answers 404."""


class ConfigError(JaxserveError):
    """A settings file or flag is unknown or has a value of the wrong kind."""


class LoraAdapterError(JaxserveError):
    """A LoRA adapter folder is missing, unreadable, or inconsistent with itself (its config and its tensors)."""


class UnsupportedLoraError(LoraAdapterError):
    """A valid PEFT adapter that uses something jaxserve does not serve (DoRA, trained biases or embeddings, LoRA on
    modules other than the decoder projections, per-module ranks, another PEFT method)."""


class LoraNameTakenError(LoraAdapterError):
    """An adapter's name or id already belongs to another adapter of the engine."""


class LoraRankError(LoraAdapterError):
    """The adapter's rank is above the largest the server was started for (max_lora_rank)."""


class LoraBaseModelMismatchError(LoraAdapterError):
    """The adapter was made for another base model: its modules, layers or tensor shapes disagree with the served
    model's config."""


class EngineStepError(Exception):
    """A step of the engine failed while running the request; the server answers 500 and keeps serving."""


class EngineDeadError(Exception):
    """The engine thread is gone (failed or shutting down): nothing more can run; the server answers 503."""
