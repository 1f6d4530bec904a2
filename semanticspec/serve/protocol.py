"""The OpenAI wire format the endpoint reads and writes: request models, response and chunk bodies, error JSON.

Requests are checked by pydantic: a value of the wrong type, NaN or an infinity is refused with a 400 in OpenAI's
error JSON naming the field. OpenAI's fields that the endpoint cannot honour (penalties, ``logit_bias``, ``best_of``,
``logprobs``, tools...) are accepted at their neutral values, which the SDKs send, and refused by name as "not
supported" otherwise (:data:`NEUTRAL`). A field that is not OpenAI's and not SemanticSpec's is refused as unknown:
vLLM's ``OpenAIBaseModel`` (``extra="allow"``) ignores such a field with a logged warning, which lets a misspelt
``temprature`` decode at the default silently. SemanticSpec's own options ride in the body beside OpenAI's fields (the
``extra_body`` of the ``openai`` client), as vLLM's extra sampling parameters do: ``method``, ``threshold``,
``lookahead``, ``window_min_logprob``, ``target_first_step`` and ``allow_sampling_mismatch``. The fields are OpenAI's
as the ``openai`` package 3.63 sends them (``types/completion_create_params.py``,
``types/chat/completion_create_params.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, JsonValue, StrictBool, StrictFloat, StrictInt,
                      StrictStr, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from generation.specs import is_finite


def _a_float(value: float | int) -> float | int:
    """A number field's value, refused where it is an integer no float holds (:func:`generation.specs.is_finite`):
    JSON's integers have no bound, and one past a float's range (``1`` and 400 zeros) overflowed ``float()`` into a
    500, where ``1e400`` is refused as not finite."""
    if not is_finite(value):
        raise PydanticCustomError("finite_number", "Input should be a finite number")
    return value


Number = Annotated[StrictFloat | StrictInt, AfterValidator(_a_float)]
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)

COMPLETIONS_DEFAULT_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` writes at most 16 tokens (OpenAI's and vLLM's default), capped at the
room the prompt leaves; ``/v1/chat/completions`` without it writes up to the room the prompt leaves (vLLM's rule)."""

NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "best_of": (1,), "suffix": ("",), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,),
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none", "auto"), "store": (False,),
    "metadata": ({},), "service_tier": ("auto", "default"), "modalities": (["text"],), "top_k": (0, -1),
    "min_p": (0,), "ignore_eos": (False,), "prediction": (), "audio": (), "reasoning_effort": (),
    "web_search_options": (), "verbosity": ("medium",), "moderation": (),
}
"""OpenAI's (and vLLM's common extra) request fields the endpoint cannot honour, each with the values that ask for
nothing (``null`` always does): accepted and ignored, any other value refused as not supported, naming the field.
The ``openai`` SDK, LangChain and others send several of them at these values."""


MESSAGE_NEUTRAL: dict[str, tuple] = {"refusal": (), "tool_calls": ([],), "tool_call_id": (), "function_call": (),
                                     "audio": (), "annotations": ([],)}
"""OpenAI's message fields the endpoint cannot honour, as :data:`NEUTRAL`: an answer's message passed back whole (the
``openai`` SDK's ``message.model_dump()``) carries them at null."""


def unsupported(body: BaseModel) -> tuple[str, str] | None:
    """The first field of ``body`` (or of one of its chat messages) set to a value the endpoint cannot honour:
    ``(field, message)``, or None."""
    for where, part, neutral in (("", body, NEUTRAL), *((f"messages.{i}.", m, MESSAGE_NEUTRAL)
                                                        for i, m in enumerate(getattr(body, "messages", ())))):
        for name in neutral:
            value = getattr(part, name, None)
            if value is not None and not any(_same(value, v) for v in neutral[name]):
                ok = " or ".join(repr(v) for v in (None, *neutral[name]))
                return where + name, f"{where}{name}={value!r}: not supported by this endpoint (accepted: {ok})"
    return None


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 0 == 0.0, but True is not 1."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def lone_surrogate(value: Any, where: str = "") -> tuple[str, str] | None:
    """The first string in ``value`` (a request body as JSON values) that is not Unicode text: ``(field, message)``.
    JSON may escape half a UTF-16 pair (``"\\ud800"``), which ``json.loads`` reads into a str no tokenizer or UTF-8
    encoder takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return where, (f"{where or 'body'}: holds a lone UTF-16 surrogate (U+{ord(value[e.start]):04X}) at "
                           f"character {e.start}, which is not Unicode text; send the character itself or a whole "
                           "surrogate pair")
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if (hit := lone_surrogate(v, f"{where}.{k}" if where else str(k))) is not None:
            return hit
    return None


class _Part(BaseModel):
    """A part of a request: a field OpenAI lets be null takes its default at null (an SDK sends an argument given as
    None so), as vLLM's ``Optional`` fields do; a required field at null is still refused."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}


class StreamOptions(_Part):
    include_usage: StrictBool = False
    continuous_usage_stats: Literal[False] = False
    include_obfuscation: StrictBool | None = None
    """OpenAI pads chunks with random ``obfuscation`` text unless false; this endpoint pads none either way."""


class _Request(_Part):
    """The fields both routes read."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, description="output token budget (the decoder's max_new_tokens); "
                                         "None: the route's default")
    max_completion_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = Field(None, ge=-2**63, le=2**63 - 1)  # int64, as vLLM bounds it (protocol.py, _LONG_INFO)
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
    target_first_step: StrictBool | None = Field(None, description="the target writes each row's first step (None: "
                                                 "the decoder's config)")
    allow_sampling_mismatch: StrictBool = False
    # OpenAI's fields the endpoint cannot honour: accepted at their neutral values (NEUTRAL)
    presence_penalty: JsonValue = None
    frequency_penalty: JsonValue = None
    repetition_penalty: JsonValue = None
    logit_bias: JsonValue = None
    logprobs: JsonValue = None
    top_k: JsonValue = None
    min_p: JsonValue = None
    ignore_eos: JsonValue = None
    response_format: JsonValue = None
    store: JsonValue = None
    metadata: JsonValue = None
    service_tier: JsonValue = None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt string."""

    prompt: StrictStr | list[StrictStr]
    echo: JsonValue = None
    best_of: JsonValue = None
    suffix: JsonValue = None
    default_tokens: ClassVar[int | None] = COMPLETIONS_DEFAULT_TOKENS

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_only(cls, prompt: Any) -> Any:
        """Token ids (OpenAI's other prompt form) are refused as such, not as "not a valid string"."""
        if isinstance(prompt, list) and prompt and all(isinstance(x, (int, list)) for x in prompt):
            raise PydanticCustomError("unsupported", "token ids are not supported by this endpoint; send the "
                                                     "prompt's text")
        return prompt


class TextPart(_Part):
    """A text part of a message's content (OpenAI's content-part list); other part types are not supported."""

    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None
    # OpenAI's message fields the endpoint cannot honour: accepted at their neutral values (MESSAGE_NEUTRAL)
    refusal: JsonValue = None
    tool_calls: JsonValue = None
    tool_call_id: JsonValue = None
    function_call: JsonValue = None
    audio: JsonValue = None
    annotations: JsonValue = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A part of another type (``image_url``, ``input_audio``, ``file``) is refused naming its type."""
        other = next((p.get("type") for p in content if isinstance(p, dict) and p.get("type") != "text"), None) \
            if isinstance(content, list) else None
        if other is not None:
            raise PydanticCustomError("unsupported", "a content part of type '{kind}' is not supported by this "
                                                     "endpoint; it reads text parts", {"kind": str(other)})
        return content

    def as_template_turn(self) -> dict:
        """The turn a chat template reads: text parts joined by newlines (vLLM's ``"string"`` content format,
        ``entrypoints/chat_utils.py``), and ``developer`` read as ``system`` (OpenAI's newer name for it; templates
        know ``system``)."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        turn = {"role": "system" if self.role == "developer" else self.role, "content": text}
        return turn if self.name is None else {**turn, "name": self.name}


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: messages, formatted with the target tokenizer's chat template."""

    messages: list[ChatMessage]
    # hints about the caller and OpenAI's prompt cache: read by nothing here, as ``user``
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: JsonValue = None
    top_logprobs: JsonValue = None
    tools: JsonValue = None
    tool_choice: JsonValue = None
    parallel_tool_calls: JsonValue = None
    functions: JsonValue = None
    function_call: JsonValue = None
    modalities: JsonValue = None
    prediction: JsonValue = None
    audio: JsonValue = None
    reasoning_effort: JsonValue = None
    web_search_options: JsonValue = None
    verbosity: JsonValue = None
    moderation: JsonValue = None
    default_tokens: ClassVar[int | None] = None  # the room the prompt leaves


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: int | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Reply:
    """The ids, times and model name one request's bodies and chunks share."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def chunk(self, delta: str, finish: str | None = None, *, role: bool = False) -> dict:
        """One server-sent chunk: ``delta`` text, and on the last one its ``finish_reason``. ``role``: a chat's first
        chunk, the assistant's role with empty content and nothing else, as OpenAI and vLLM open a stream (vLLM
        ``entrypoints/openai/serving_chat.py``, ``chat_completion_stream_generator``, at 003fe59)."""
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else {"content": delta} if delta else {}
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
