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


def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from outside (HF's `_get_template_variables`): keywords of
    `apply_chat_template` that are not among them go to the processor call."""
    from jinja2 import meta

    compiled_env = _compile_chat_template("").environment
    return frozenset(meta.find_undeclared_variables(compiled_env.parse(template)))


def normalize_conversations(messages) -> tuple[list[list[dict[str, Any]]], bool]:
    """`(conversations, batched)`: one conversation or a list of them, None-valued keys dropped and
    OpenAI `image_url` parts turned into HF image parts, as HF's `_normalize_conversations`."""
    batched = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
    conversations = []
    for conv in (list(messages) if batched else [messages]):
        out = []
        for message in conv:
            message = _drop_none(message)
            if isinstance(message.get("content"), list):
                message["content"] = [
                    {"type": "image", "url": part["image_url"].get("url", "") if isinstance(part["image_url"], dict)
                     else part["image_url"]}
                    if isinstance(part, dict) and part.get("type") == "image_url" and "image_url" in part else part
                    for part in message["content"]]
            out.append(message)
        conversations.append(out)
    return conversations, batched


def media_of(conversations) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per conversation, the payloads of its image parts ("image" / "url" / "path") and video parts
    ("video" / "url" / "path"), as HF's `_multimodal_inputs_from_conversations` collects them: a
    video part's payload is one video (a file, an array, or a list of frame images or files)."""
    images, videos = [], []
    for conv in conversations:
        conv_images, conv_videos = [], []
        for message in conv:
            content = message.get("content")
            if not isinstance(content, (list, tuple)):
                continue
            for part in content:
                kind = part.get("type")
                if kind == "image":
                    conv_images.extend(part[k] for k in ("image", "url", "path") if k in part)
                elif kind == "video":
                    conv_videos.extend(part[k] for k in ("video", "url", "path") if k in part)
        images.append(conv_images)
        videos.append(conv_videos)
    return images, videos


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render(compiled, template: str, conversation: list[dict[str, Any]], *, continue_final_message=False,
           **variables) -> str:
    """One conversation through the template; with `continue_final_message` the last message is
    left open (HF's `render_jinja_template`: the text is tagged, rendered, and cut at the tag)."""
    if not continue_final_message:
        return compiled.render(messages=conversation, **variables)
    if not conversation:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    conversation = [dict(m) for m in conversation]
    last = conversation[-1]
    final = last.get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    if field not in template:
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):
        blocks = [dict(b) if isinstance(b, dict) else b for b in final]
        for block in reversed(blocks):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but we could not find any text to continue in the "
                             "final message!")
        last[field] = blocks
    else:
        last[field] = final + _CONTINUE_TAG
    rendered = compiled.render(messages=conversation, **variables)
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing spacing


def _drop_none(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                          for part in out["content"]]
    return out
