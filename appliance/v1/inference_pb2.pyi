from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CachePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_POLICY_DEFAULT: _ClassVar[CachePolicy]
    CACHE_POLICY_BYPASS: _ClassVar[CachePolicy]
    CACHE_POLICY_REFRESH: _ClassVar[CachePolicy]
    CACHE_POLICY_ONLY: _ClassVar[CachePolicy]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class CacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_TIER_MISS: _ClassVar[CacheTier]
    CACHE_TIER_EXACT_L1: _ClassVar[CacheTier]
    CACHE_TIER_EXACT_L2: _ClassVar[CacheTier]
    CACHE_TIER_SEMANTIC: _ClassVar[CacheTier]
    CACHE_TIER_OTHER: _ClassVar[CacheTier]

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_AUTO: _ClassVar[ToolChoice]
    TOOL_CHOICE_NONE: _ClassVar[ToolChoice]
    TOOL_CHOICE_REQUIRED: _ClassVar[ToolChoice]

class GuideType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GUIDE_TYPE_UNSPECIFIED: _ClassVar[GuideType]
    GUIDE_TYPE_JSON: _ClassVar[GuideType]
    GUIDE_TYPE_JSON_SCHEMA: _ClassVar[GuideType]
    GUIDE_TYPE_REGEX: _ClassVar[GuideType]
    GUIDE_TYPE_EBNF_GRAMMAR: _ClassVar[GuideType]
CACHE_POLICY_DEFAULT: CachePolicy
CACHE_POLICY_BYPASS: CachePolicy
CACHE_POLICY_REFRESH: CachePolicy
CACHE_POLICY_ONLY: CachePolicy
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
CACHE_TIER_MISS: CacheTier
CACHE_TIER_EXACT_L1: CacheTier
CACHE_TIER_EXACT_L2: CacheTier
CACHE_TIER_SEMANTIC: CacheTier
CACHE_TIER_OTHER: CacheTier
TOOL_CHOICE_AUTO: ToolChoice
TOOL_CHOICE_NONE: ToolChoice
TOOL_CHOICE_REQUIRED: ToolChoice
GUIDE_TYPE_UNSPECIFIED: GuideType
GUIDE_TYPE_JSON: GuideType
GUIDE_TYPE_JSON_SCHEMA: GuideType
GUIDE_TYPE_REGEX: GuideType
GUIDE_TYPE_EBNF_GRAMMAR: GuideType

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments", "id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    id: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class Tools(_message.Message):
    __slots__ = ("tools", "choice", "function_name")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    choice: ToolChoice
    function_name: str
    def __init__(self, tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., choice: _Optional[_Union[ToolChoice, str]] = ..., function_name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Guide(_message.Message):
    __slots__ = ("type", "guide")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    GUIDE_FIELD_NUMBER: _ClassVar[int]
    type: GuideType
    guide: str
    def __init__(self, type: _Optional[_Union[GuideType, str]] = ..., guide: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "cache_policy", "namespace", "ttft_budget_ms", "semantic_cache", "guide", "min_tokens", "ignore_eos", "logprobs", "top_logprobs", "speculation", "tools")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TTFT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_CACHE_FIELD_NUMBER: _ClassVar[int]
    GUIDE_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    messages: ChatMessages
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    cache_policy: CachePolicy
    namespace: str
    ttft_budget_ms: int
    semantic_cache: bool
    guide: Guide
    min_tokens: int
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    speculation: bool
    tools: Tools
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., cache_policy: _Optional[_Union[CachePolicy, str]] = ..., namespace: _Optional[str] = ..., ttft_budget_ms: _Optional[int] = ..., semantic_cache: _Optional[bool] = ..., guide: _Optional[_Union[Guide, _Mapping]] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., speculation: _Optional[bool] = ..., tools: _Optional[_Union[Tools, _Mapping]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_us", "ttft_us", "total_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    TTFT_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    ttft_us: int
    total_us: int
    def __init__(self, queue_us: _Optional[int] = ..., ttft_us: _Optional[int] = ..., total_us: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "cache_tier", "model", "degraded", "similarity", "cache_entry", "cache_tier_name", "draft_tokens", "accepted_draft_tokens", "tool_call")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TIER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRY_FIELD_NUMBER: _ClassVar[int]
    CACHE_TIER_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    cache_tier: CacheTier
    model: str
    degraded: bool
    similarity: float
    cache_entry: str
    cache_tier_name: str
    draft_tokens: int
    accepted_draft_tokens: int
    tool_call: ToolCall
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., cache_tier: _Optional[_Union[CacheTier, str]] = ..., model: _Optional[str] = ..., degraded: _Optional[bool] = ..., similarity: _Optional[float] = ..., cache_entry: _Optional[str] = ..., cache_tier_name: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "final", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: Final
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "final", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: Final
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("namespace", "model", "all", "entry")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model: str
    all: bool
    entry: str
    def __init__(self, namespace: _Optional[str] = ..., model: _Optional[str] = ..., all: _Optional[bool] = ..., entry: _Optional[str] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("l1_removed", "l2_removed", "semantic_removed", "removed")
    class RemovedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    L1_REMOVED_FIELD_NUMBER: _ClassVar[int]
    L2_REMOVED_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_REMOVED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    l1_removed: int
    l2_removed: int
    semantic_removed: int
    removed: _containers.ScalarMap[str, int]
    def __init__(self, l1_removed: _Optional[int] = ..., l2_removed: _Optional[int] = ..., semantic_removed: _Optional[int] = ..., removed: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStatsResponse(_message.Message):
    __slots__ = ("counters",)
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ...) -> None: ...
