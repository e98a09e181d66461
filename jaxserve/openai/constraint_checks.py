"""The output constraints a request brings (its structured output, its tools' argument schemas), compiled before the
request reaches the engine, so that what cannot compile is a 400 naming the field that gave it.

They are gathered while the body is parsed, then compiled by the engine's GrammarCompiler: waited for on the caller's
thread (run-batch), or awaited on the event loop (the server), where no thread is held while a grammar compiles and a
slow one delays only its own request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.openai.bodies import structured_outputs_from_body
from jaxserve.openai.tool_calls import ToolCalling
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams


@dataclasses.dataclass(frozen=True)
class ConstraintCheck:
    """One constraint to compile, and how its failure reads."""

    constraint: StructuredOutputsParams  # what must compile
    param: str  # the request field a failure names
    where: str = ""  # said before the compiler's message: which part of that field

    def refusal(self, error: InvalidRequestError) -> InvalidRequestError:
        return InvalidRequestError(f"{self.where}{error}", param=self.param)


def tool_schema_checks(tool_calling: ToolCalling | None) -> list[ConstraintCheck]:
    """Every tool's arguments schema; one that is not valid JSON Schema is refused here already."""
    if tool_calling is None:
        return []
    return [_tool_schema_check(index, schema) for index, schema in tool_calling.parameter_schemas()]


def output_constraint_checks(params: SamplingParams, body: dict[str, Any],
                             tool_calling: ToolCalling | None = None) -> list[ConstraintCheck]:
    """The request's output constraint (the one `params` carries), if any."""
    if params.structured_outputs is None:
        return []
    return [ConstraintCheck(params.structured_outputs, structured_outputs_from_body(body, tool_calling)[1])]


def check_constraints(checks: Sequence[ConstraintCheck], grammars: GrammarCompiler) -> None:
    """Compiles them all, waiting on this thread; raises the first failure's refusal."""
    _start(checks, grammars)
    for check in checks:
        try:
            grammars.check(check.constraint)
        except InvalidRequestError as error:
            raise check.refusal(error) from None


async def await_constraints(checks: Sequence[ConstraintCheck], grammars: GrammarCompiler) -> None:
    """`check_constraints` awaited on the running event loop."""
    _start(checks, grammars)
    for check in checks:
        try:
            await grammars.compiled(check.constraint)
        except InvalidRequestError as error:
            raise check.refusal(error) from None


def _start(checks: Sequence[ConstraintCheck], grammars: GrammarCompiler) -> None:
    """Every compile submitted before any is waited for, so they run side by side."""
    for check in checks:
        grammars.compile(check.constraint)


def _tool_schema_check(index: int, schema: dict[str, Any]) -> ConstraintCheck:
    param = f"tools[{index}].function.parameters"  # OpenAI's name of the field at fault
    where = f"{param} is not a usable JSON Schema: "
    try:
        return ConstraintCheck(StructuredOutputsParams(json=schema), param, where)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"{where}{error}", param=param) from None
