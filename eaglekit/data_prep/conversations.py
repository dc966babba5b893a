"""Conversation readers: ShareGPT / OpenAI-style messages → a list of {role, content} turns."""
from __future__ import annotations

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}


class ConversationError(ValueError):
    """A malformed conversation item; the message names the file and item."""


def normalise_messages(turns: list[dict], where: str = "") -> list[dict]:
    """ShareGPT ``{from, value}`` or OpenAI ``{role, content}`` turns → ``[{role, content}]``.

    Roles are mapped to user/assistant/system; an unknown role raises ConversationError naming ``where``.
    """
    out = []
    for i, t in enumerate(turns):
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        norm = ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        if norm is None:
            raise ConversationError(f"{where}turn {i}: unknown role {role!r}")
        out.append({"role": norm, "content": content})
    return out
