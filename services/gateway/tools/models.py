"""Request fields of structured output and tool calling (OpenAI chat completions), at the
HTTP edge: ``response_format``, ``tools``, ``tool_choice``, ``parallel_tool_calls``, and the
``tool_calls`` / ``tool_call_id`` of messages. Strict pydantic models (unknown fields are
refused); schemas are checked later, when their grammar is built (``shared/structured.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: OpenAI's rule for function names.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
#: Most tools one request may declare.
MAX_TOOLS = 128


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaSpec(_Base):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    def as_dict(self) -> dict:
        """The shape :func:`shared.structured.response_format_grammar` reads."""
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_,
                                  "strict": self.json_schema.strict}
        return out


class FunctionDef(_Base):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Base):
    type: Literal["function"]
    function: FunctionDef

    def as_dict(self) -> dict:
        """The OpenAI (and Hugging Face chat template) shape, without unset fields."""
        fn: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            fn["description"] = self.function.description
        fn["parameters"] = self.function.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class NamedFunction(_Base):
    name: FunctionName


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Base):
    name: str
    arguments: str


class ToolCallIn(_Base):
    """An assistant message's earlier tool call, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
