"""Request bodies of the OpenAI-compatible endpoints, and the error type the server answers with.

Only the fields the server acts on are declared; unknown fields are ignored (clients send new parameters before
servers know them). Fields whose non-default values the engine cannot honour are declared so that a request using
them is refused with a 400 instead of being silently served differently (see `unsupported_fields`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat


class RequestError(Exception):
    """A request the server refuses; answered as OpenAI's error body with `status`."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False


class _SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # not OpenAI's; common in compatible servers (None, 0 or -1: off)
    n: StrictInt | None = 1
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported_fields(self) -> list[str]:
        bad = _truthy(self, ("presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix"))
        if self.logprobs is not None:  # logprobs=0 asks for the sampled token's logprob: also unsupported
            bad.append("logprobs")
        if self.best_of is not None and self.best_of != (self.n or 1):
            bad.append("best_of")
        return bad


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        bad = _truthy(self, ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "tools",
                             "functions"))
        if self.tool_choice not in (None, "none", "auto"):
            bad.append("tool_choice")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
        return bad


def _truthy(req: _SamplingRequest, names: tuple[str, ...]) -> list[str]:
    """The named fields the request set to something (those we do not implement: a 400 lists them)."""
    return [name for name in names if getattr(req, name)]
