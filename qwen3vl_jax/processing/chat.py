"""Chat templates: rendering with HF's Jinja environment, and the media parts of messages."""

from __future__ import annotations

import json
from typing import Any

def _compile_chat_template(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        from datetime import datetime
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)



_CALL_KEYS = {"video_metadata", "return_tensors", "padding", "padding_side", "return_metadata",
              "video_tokens_per_frame", "images_kwargs", "videos_kwargs", "fps", "num_frames",
              "do_sample_frames", "min_frames", "max_frames", "size", "min_pixels", "max_pixels",
              "input_data_format", "num_threads", "cap_pixels_per_frame", "max_video_tokens"}


def _drop_none(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                          for part in out["content"]]
    return out