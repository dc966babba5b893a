"""Conversation readers: ShareGPT / OpenAI-style messages → validated ``{id, messages}`` items.

Accepted inputs: a ``.json`` file (a list of items, or one item), a ``.jsonl`` file (one item a line), a
folder of those (sorted, recursive), or a ``datasets`` dataset saved with ``save_to_disk``. An item holds
``conversations: [{from, value}]`` (ShareGPT) or ``messages: [{role, content}]`` (OpenAI / UltraChat),
and optionally a top-level ``system`` prompt and an ``id``.

A malformed item (a JSONL line that is not UTF-8 or not JSON, unknown role, empty content,
non-alternating turns) is never dropped silently: with ``strict=True`` it raises ConversationError
naming the file and line/index; otherwise it is skipped, and the returned list's ``.skipped`` names
every skipped item and why. A binary file (a NUL byte) is refused whole, strict or not.

Two artefacts of scraped chat data are repaired rather than rejected, because they are the norm in
ShareGPT's split files (a third of the items begin mid-conversation): leading assistant turns before the
first user turn are dropped, and a trailing user turn (nothing to learn from) is dropped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eaglekit import assets

log = logging.getLogger(__name__)

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}


class ConversationError(ValueError):
    """A malformed conversation item; the message names the file and item."""


class Conversations(list):
    """A list of ``{"id", "messages"}`` items plus ``.skipped``: ``["file:line: reason", ...]`` and
    ``.unanswered``: how many items had ``"messages": []`` (regeneration's placeholder for a prompt it did not
    answer, kept so the file stays an input-order prefix; not malformed)."""

    def __init__(self, items=(), skipped=None, unanswered: int = 0):
        super().__init__(items)
        self.skipped: list[str] = list(skipped or [])
        self.unanswered = unanswered


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


def validate_messages(messages: list[dict], where: str = "", repair: bool = True) -> list[dict]:
    """Check content and turn order: [system] user assistant user assistant ...; return the cleaned list.

    ``repair`` drops leading assistant turns and a trailing user turn (see the module docstring).
    """
    for i, m in enumerate(messages):
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ConversationError(f"{where}turn {i} ({m['role']}): empty or non-text content")
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system) :]
    if repair:
        while rest and rest[0]["role"] == "assistant":
            rest = rest[1:]
        if rest and rest[-1]["role"] == "user":
            rest = rest[:-1]
    if not rest:
        raise ConversationError(f"{where}no user/assistant exchange")
    for i, m in enumerate(rest):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise ConversationError(
                f"{where}turn {i + len(system)}: expected {want}, got {m['role']} "
                "(turns must alternate user/assistant after an optional system prompt)"
            )
    if rest[-1]["role"] != "assistant":
        raise ConversationError(f"{where}last turn is not an assistant turn")
    return system + rest


def item_messages(item: dict, where: str = "", repair: bool = True) -> list[dict]:
    """One raw item (ShareGPT or OpenAI shaped) → validated ``[{role, content}]``."""
    if not isinstance(item, dict):
        raise ConversationError(f"{where}item is a {type(item).__name__}, not an object")
    turns = item.get("messages", item.get("conversations"))
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ConversationError(f"{where}no 'messages' or 'conversations' list of turn objects")
    messages = normalise_messages(turns, where)
    system = item.get("system")
    if system and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": system}] + messages
    return validate_messages(messages, where, repair)


def _raw_items(path: Path, split: str | None):
    """Yield ``(where, item_or_exception)`` for every item of ``path`` (file, folder or saved dataset)."""
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        yield from _dataset_items(path, split)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
        if not files:
            raise ConversationError(f"{path}: folder holds no .json/.jsonl files")
        for f in files:
            yield from _raw_items(f, split)
    elif path.suffix == ".jsonl":
        yield from _jsonl_items(path)
    elif path.suffix == ".json":
        refuse_binary(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as e:
            raise ConversationError(f"{path}: not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from e
        except json.JSONDecodeError as e:
            raise ConversationError(f"{path}: bad JSON at line {e.lineno} ({e.msg})") from e
        for i, item in enumerate(data if isinstance(data, list) else [data]):
            yield f"{path}[{i}]: ", item
    elif not path.exists():
        raise FileNotFoundError(f"conversation data not found: {path}")
    else:
        raise ConversationError(
            f"{path}: unsupported file type (want .json, .jsonl, a folder or a saved dataset)"
        )


def refuse_binary(path: Path, probe: int = 1 << 16) -> None:
    """Raise ConversationError if ``path`` looks binary (a NUL byte in its first 64 KiB): JSON text never
    holds one, and a binary file read line by line would only yield a stream of per-line errors."""
    with path.open("rb") as fh:
        head = fh.read(probe)
    nul = head.find(b"\0")
    if nul >= 0:
        raise ConversationError(f"{path}: binary file (NUL byte at offset {nul}), not JSON/JSONL text")


def _jsonl_items(path: Path):
    """One item per line, read as bytes so that a line that is not UTF-8 is named and skipped alone."""
    refuse_binary(path)
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            where = f"{path}:{n}: "
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a BOM may open the file
            except UnicodeDecodeError as e:
                yield where, ConversationError(f"{where}not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, ConversationError(f"{where}bad JSON ({e.msg})")


def _dataset_items(path: Path, split: str | None):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else (next(iter(ds)) if len(ds) == 1 else None))
        if name not in ds:
            raise ConversationError(f"{path}: pick a split with split=... (has {sorted(ds)})")
        ds = ds[name]
    for i in range(len(ds)):
        yield f"{path}[{i}]: ", ds[i]


def load_sharegpt(strict: bool = False, limit: int | None = None) -> Conversations:
    """The embedded ShareGPT (``assets.sharegpt_items``), each item validated like a file's: a malformed one
    is named and skipped (``.skipped``), or with ``strict`` stops the read; ``limit`` good items at most."""
    good, skipped = [], []
    for i, item in enumerate(assets.sharegpt_items()):
        try:
            good.append({"id": str(item.get("id")), "messages": item_messages(item, f"sharegpt[{i}]: ")})
        except ConversationError as e:
            if strict:
                raise
            skipped.append(str(e))
        if limit and len(good) >= limit:
            break
    return Conversations(good, skipped)


def read_conversations(
    path: str | Path,
    strict: bool = False,
    split: str | None = None,
    repair: bool = True,
    limit: int | None = None,
) -> Conversations:
    """Read and validate every conversation under ``path`` → ``Conversations`` of ``{"id", "messages"}``.

    ``strict`` raises on the first malformed item; otherwise malformed items are skipped, counted in
    ``.skipped`` and summarised in one warning. ``limit`` stops after that many good items.
    """
    path = Path(path)
    good, skipped, unanswered = [], [], 0
    for where, item in _raw_items(path, split):
        if isinstance(item, dict) and item.get("messages") == []:
            unanswered += 1
            continue
        try:
            if isinstance(item, Exception):
                raise item
            messages = item_messages(item, where, repair)
        except ConversationError as e:
            if strict:
                raise
            skipped.append(str(e))
            continue
        good.append({"id": str(item.get("id", where.rstrip(": "))), "messages": messages})
        if limit is not None and len(good) >= limit:
            break
    if skipped:
        log.warning("%s: skipped %d malformed conversation(s), first: %s", path, len(skipped), skipped[0])
    if unanswered:
        log.info("%s: %d conversation(s) without an answer (\"messages\": [])", path, unanswered)
    return Conversations(good, skipped, unanswered)
