"""A chat body's conversation: `parse_messages` checks `messages` into the shape the chat template receives;
`chat_options` reads how the conversation becomes a prompt (vLLM's chat extensions) into ChatOptions.
/v1/chat/completions (serving/protocol.py) and POST /tokenize (serving/tokenize_routes.py) both read a chat
here, so they render the same ids.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from octavo.serving.api_error import bad_request
from octavo.serving.body import Body, listed, show

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# a role outside _CHAT_ROLES is handed to the chat template (which may refuse it) if it is a plain word: no
# whitespace or markup that could forge the template's own role delimiters
_CUSTOM_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


@dataclass(slots=True)
class ChatOptions:
    """How the conversation becomes a prompt (vLLM's chat extensions)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    echo: bool = False  # the reply starts with the last message's content when that message is the assistant's
    chat_template: str | None = None  # this request's own template (rendered in the same sandbox)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables
    add_special_tokens: bool = False  # BOS etc. on top of what the template writes


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                  "are supported", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _tool_calls(m: dict[str, Any], i: int) -> list[dict[str, Any]] | None:
    """An assistant message's earlier tool calls, checked, in OpenAI's shape."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    if m.get("role") != "assistant" or not isinstance(calls, list):
        raise bad_request(f"'{where}' must be a list, on an assistant message", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str)
                or c.get("type", "function") != "function"):
            raise bad_request(f"'{where}[{j}]' must be {{'id', 'type': 'function', 'function': {{'name': str, "
                              "'arguments': JSON text}}}}", "messages")
        out.append({"id": c["id"] if isinstance(c.get("id"), str) else f"call_{i}_{j}", "type": "function",
                    "function": {"name": f["name"], "arguments": f["arguments"]}})
    return out


def parse_messages(b: Body) -> list[dict[str, Any]]:
    """The body's `messages`, checked, as the chat template receives them."""
    msgs = b.d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in _CHAT_ROLES and not (isinstance(role, str) and _CUSTOM_ROLE.fullmatch(role)):
            raise bad_request(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, or another role the "
                              "chat template accepts written as a plain word (letters, digits, '_', '-', '.'; "
                              f"at most 64), got {show(role)}", "messages")
        msg: dict[str, Any] = {"role": role, "content": _content(m, i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        calls = _tool_calls(m, i)
        if calls:
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise bad_request(f"'messages[{i}].tool_call_id' must be a string", "messages")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


# names the renderer sets itself: chat_template_kwargs may not replace them (their own fields do that)
# (and the renderer's own options: a variable of that name would reach encode_chat, not the template)
_TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
                      "raise_exception", "tools", "documents", "chat_template", "add_special_tokens",
                      "special_tokens_in_content")
MAX_CHAT_TEMPLATE_CHARS = 64 << 10


def chat_options(b: Body, messages: list[dict[str, str]]) -> ChatOptions:
    """The body's chat rendering options, checked against MESSAGES (parse_messages' result)."""
    add_gen = b.boolean("add_generation_prompt", True)
    cont = b.boolean("continue_final_message", False)
    if add_gen and cont:
        raise bad_request("'continue_final_message' continues the last message, so it needs "
                          "'add_generation_prompt': false (both cannot be true)", "continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' needs the last message to be the assistant's (the text to "
                          f"continue), got role {messages[-1]['role']!r}", "continue_final_message")
    template = b.string("chat_template", None)
    if template is not None and not template.strip():
        raise bad_request("'chat_template' must not be empty", "chat_template")
    if template is not None and len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise bad_request(f"'chat_template' is {len(template)} characters; at most {MAX_CHAT_TEMPLATE_CHARS}",
                          "chat_template")
    kwargs = b.d.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
    clash = [k for k in kwargs if k in _TEMPLATE_RESERVED]
    if clash:
        raise bad_request(f"'chat_template_kwargs' may not set {listed(clash)}: the renderer sets them (use the "
                          "request fields of those names where there is one)", "chat_template_kwargs")
    return ChatOptions(add_generation_prompt=add_gen, continue_final_message=cont, echo=b.boolean("echo", False),
                       chat_template=template, chat_template_kwargs=dict(kwargs),
                       add_special_tokens=b.boolean("add_special_tokens", False))


__all__ = ["MAX_CHAT_TEMPLATE_CHARS", "ChatOptions", "chat_options", "parse_messages"]
