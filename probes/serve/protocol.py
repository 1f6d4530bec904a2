"""The OpenAI wire format the endpoint reads and writes: request models, response and chunk bodies, error JSON.

Requests are checked by pydantic: an unknown field or a value of the wrong type is refused with a 400 in OpenAI's
error JSON naming the field, as vLLM's server does. SemanticSpec's own options ride in the body beside OpenAI's
fields (the ``extra_body`` of the ``openai`` client), as vLLM's extra sampling parameters do: ``method``,
``threshold``, ``lookahead``, ``window_min_logprob`` and ``allow_sampling_mismatch``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Request(BaseModel):
    """The fields both routes read."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    max_tokens: StrictInt = Field(256, description="output token budget (the decoder's max_new_tokens)")
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # SemanticSpec's options (the client's extra_body)
    method: StrictStr = "semanticspec"
    threshold: Number | None = Field(None, description="the probe policy's tau (threshold rule)")
    lookahead: StrictInt | None = None
    window_min_logprob: Number | None = None
    allow_sampling_mismatch: StrictBool = False

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt string."""

    prompt: StrictStr | list[StrictStr]
    max_completion_tokens: StrictInt | None = None
    echo: Literal[False] = False
    logprobs: None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: messages, formatted with the target tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: Literal[False] | None = None


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: int | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Reply:
    """The ids, times and model name one request's bodies and chunks share."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def chunk(self, delta: str, finish: str | None = None, first: bool = False) -> dict:
        """One server-sent chunk: ``delta`` text, and on the last one its ``finish_reason``."""
        if self.chat:
            d = ({"role": "assistant", "content": delta} if first else {"content": delta}) if delta or first else {}
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            return self._body("chat.completion.chunk", [choice])
        return self._body("text_completion", [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}])

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._body("chat.completion.chunk" if self.chat else "text_completion", []), "usage": usage}

    def full(self, text: str, finish: str, usage: dict) -> dict:
        """The non-streaming body."""
        written = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = {"index": 0, **written, "logprobs": None, "finish_reason": finish}
        return {**self._body("chat.completion" if self.chat else "text_completion", [choice]), "usage": usage}

    def _body(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def usage(prompt_tokens: int, result) -> dict:
    """OpenAI's ``usage``, with SemanticSpec's figures: draft steps proposed and kept, the share of the output tokens
    the draft wrote, and the seconds the request decoded (from joining its loop to its end)."""
    s = result.stats
    out = s.output_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": out, "total_tokens": prompt_tokens + out,
            "semanticspec": {"steps": s.steps, "draft_steps_proposed": s.draft_steps_proposed,
                             "draft_steps_accepted": s.draft_steps_accepted,
                             "draft_token_share": round(s.draft_tokens / out, 4) if out else 0.0,
                             "decode_s": round(s.wall_s, 4)}}
