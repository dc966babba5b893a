import json

import pytest

from eaglekit.data_prep import ConversationError, read_conversations

SHAREGPT = {
    "id": "s1",
    "conversations": [
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "more"},
        {"from": "gpt", "value": "sure"},
    ],
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
}


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_sharegpt_json_and_openai_jsonl(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([SHAREGPT]))
    (tmp_path / "b.jsonl").write_text(json.dumps(OPENAI) + "\n\n" + json.dumps({**OPENAI, "id": "x"}) + "\n")
    a = read_conversations(tmp_path / "a.json", strict=True)
    assert a == [
        {
            "id": "s1",
            "messages": _msgs(
                ("user", "hi"), ("assistant", "hello"), ("user", "more"), ("assistant", "sure")
            ),
        }
    ]
    b = read_conversations(tmp_path / "b.jsonl", strict=True)
    assert [c["id"] for c in b] == [f"{tmp_path / 'b.jsonl'}:1", "x"]  # blank line skipped, id from file:line
    assert b[0]["messages"] == _msgs(("system", "be brief"), ("user", "q"), ("assistant", "a"))
    both = read_conversations(tmp_path, strict=True)  # a folder: files in sorted order
    assert [c["id"] for c in both] == ["s1", f"{tmp_path / 'b.jsonl'}:1", "x"]
    assert both.skipped == []


def test_top_level_system_field_and_repairs(tmp_path):
    item = {
        "system": "sys",
        "conversations": [
            {"from": "gpt", "value": "orphan answer"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "unanswered"},
        ],
    }
    (tmp_path / "c.json").write_text(json.dumps(item))
    [c] = read_conversations(tmp_path / "c.json", strict=True)
    assert c["messages"] == _msgs(("system", "sys"), ("user", "q"), ("assistant", "a"))


def test_saved_hf_dataset(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(
        [{"id": "d0", "messages": OPENAI["messages"]}, {"id": "d1", "messages": OPENAI["messages"][1:]}]
    )
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    ds.save_to_disk(str(tmp_path / "d"))
    for p in ("dd", "d"):
        got = read_conversations(tmp_path / p, strict=True)
        assert [c["id"] for c in got] == ["d0", "d1"]
        assert got[1]["messages"] == _msgs(("user", "q"), ("assistant", "a"))


BAD = [
    ('{"messages": [', "bad JSON"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "unknown role 'wizard'"),
    (json.dumps({"messages": _msgs(("user", "q"), ("assistant", "  "))}), "empty"),
    (
        json.dumps({"messages": _msgs(("user", "q"), ("user", "q2"), ("assistant", "a"))}),
        "expected assistant",
    ),
    (json.dumps({"text": "no turns"}), "no 'messages'"),
]


@pytest.mark.parametrize("line,why", BAD)
def test_bad_items_name_file_and_line(tmp_path, line, why):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(OPENAI) + "\n" + line + "\n" + json.dumps(OPENAI) + "\n")
    with pytest.raises(ConversationError, match=rf"{f}:2: .*{why}"):
        read_conversations(f, strict=True)
    got = read_conversations(f)  # skip-and-count
    assert len(got) == 2 and len(got.skipped) == 1
    assert got.skipped[0].startswith(f"{f}:2: ") and why in got.skipped[0]


def test_bad_item_in_json_list_names_index(tmp_path):
    f = tmp_path / "l.json"
    f.write_text(json.dumps([OPENAI, {"messages": _msgs(("assistant", "a"))}]))
    with pytest.raises(ConversationError, match=rf"{f}\[1\]: no user/assistant"):
        read_conversations(f, strict=True)
    assert read_conversations(f).skipped == [f"{f}[1]: no user/assistant exchange"]


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ConversationError, match="unsupported"):
        read_conversations(tmp_path / "x.txt")


def test_limit_stops_after_good_items(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(['{"bad": 1}'] + [json.dumps({**OPENAI, "id": str(i)}) for i in range(5)]) + "\n")
    got = read_conversations(f, limit=2)
    assert [c["id"] for c in got] == ["0", "1"] and len(got.skipped) == 1


@pytest.mark.real
def test_embedded_sharegpt_is_validated_and_counted():
    from eaglekit.data_prep.prepare import PrepareConfig, load_conversations

    got = load_conversations(PrepareConfig(num_conversations=300))
    assert len(got) == 300 and got.skipped  # ShareGPT has empty turns etc.; each is named, not lost
    assert all(s.startswith("sharegpt[") for s in got.skipped)
    for c in got:
        roles = [m["role"] for m in c["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) >= 2
    with pytest.raises(ConversationError, match=r"sharegpt\[\d+\]: "):
        load_conversations(PrepareConfig(num_conversations=300, strict=True))


def test_line_not_utf8_is_named_and_skipped(tmp_path):
    f = tmp_path / "d.jsonl"
    bad = json.dumps({**OPENAI, "id": "bad"}).encode().replace(b'"q"', b'"q\xff"')
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(OPENAI).encode() + b"\n" + bad + b"\n" + json.dumps(OPENAI).encode())
    got = read_conversations(f)  # a BOM opening the file is not an error
    column = bad.index(b"\xff") + 1
    assert len(got) == 2 and got.skipped == [f"{f}:2: not UTF-8 (byte 0xff at column {column})"]
    with pytest.raises(ConversationError, match=rf"{f}:2: not UTF-8"):
        read_conversations(f, strict=True)


def test_binary_file_is_named_and_refused(tmp_path):
    for name in ("b.jsonl", "b.json"):
        f = tmp_path / name
        f.write_bytes(json.dumps(OPENAI).encode() + b"\n" + bytes(range(256)) * 4)
        with pytest.raises(ConversationError, match=rf"{f}: binary file \(NUL byte at offset"):
            read_conversations(f)  # even when not strict: the file is not text at all
    f = tmp_path / "latin1.json"
    f.write_bytes(json.dumps(OPENAI).encode().replace(b'"q"', b'"\xe9"'))
    with pytest.raises(ConversationError, match=rf"{f}: not UTF-8 \(byte 0xe9 at offset"):
        read_conversations(f)


def test_unanswered_placeholders_are_counted_not_called_malformed(tmp_path, caplog):
    """regenerate writes ``"messages": []`` for a prompt it did not answer (to keep the file an input-order
    prefix); reading the file back counts those apart and warns only about what is really malformed."""
    import json
    import logging

    from eaglekit.data_prep import read_conversations

    rows = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"id": "b", "messages": [], "regenerate_error": "stopped at a turn: prompt longer than max_prompt_tokens"},
            {"id": "c", "messages": [{"role": "user", "content": "only a question"}]}]
    path = tmp_path / "regenerated.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO):
        convs = read_conversations(path)
    assert [c["id"] for c in convs] == ["a"]
    assert convs.unanswered == 1 and len(convs.skipped) == 1 and ":3:" in convs.skipped[0]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "skipped 1 malformed" in warnings[0].getMessage()
