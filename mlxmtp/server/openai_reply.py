"""What the replies of OpenAI's two completions endpoints (/v1/chat/completions,
/v1/completions: openai_api.py) share: ids, the usage object (with mlxmtp's MTP
statistics), the finish reason, and the stream's final chunks and [DONE]."""

from __future__ import annotations

import time
import uuid
from typing import List

from .errors import openai_error_body
from .generation import Generation, finish_error
from .request_path import Reply, sse_data


def usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.stats.cached_prompt_tokens if gen.stats else 0},
            "mtp": gen.mtp_usage()}


def finish_reason(gen: Generation) -> str:
    if gen.finish_reason == "stop" and gen.tool_calls():
        return "tool_calls"
    return gen.finish_reason if gen.finish_reason in ("stop", "length") else "stop"


class OpenAIReply(Reply):
    """Ids, the final chunks (finish reason, usage, or a generation error) and [DONE]."""

    id_prefix = ""
    chunk_object = ""

    def __init__(self, state, model: str, stream: bool, include_usage: bool):
        self.tok = state.tok
        self.id = self.id_prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.stream = stream
        self.include_usage = include_usage

    def envelope(self, obj: str, choices: List[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def final_chunk(self, gen: Generation) -> str:
        raise NotImplementedError

    def finish(self, gen: Generation) -> List[str]:
        if gen.error:
            return [sse_data(openai_error_body(finish_error(gen)))]
        out = [self.final_chunk(gen)]
        if self.include_usage:
            out.append(sse_data(self.envelope(self.chunk_object, [], usage=usage(gen))))
        return out

    def closing(self) -> List[str]:
        return [sse_data("[DONE]")]
