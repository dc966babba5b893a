import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglekit.data_prep import FeatureDataset, load_draft_vocab, read_conversations
from eaglekit.data_prep.regenerate import RegenerateConfig, regenerate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest
ROOT = Path(__file__).resolve().parents[2]


def write_convs(path: Path, n: int = 12) -> Path:
    lines = []
    for i in range(n):
        msgs = [
            {"role": "user", "content": "hello " * (i % 3 + 1)},
            {"role": "assistant", "content": "abc " * (i % 4 + 1)},
        ]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "more?"}, {"role": "assistant", "content": "yes, 42."}]
        lines.append(json.dumps({"id": f"c{i}", "messages": msgs}))
    lines.insert(
        5, '{"messages": [{"role": "user", "content": "dangling"}, {"role": "user", "content": "x"}]}'
    )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


def test_prepare_cli_end_to_end(tmp_path, tiny_dir, capsys):
    from eaglekit.cli import main

    data = write_convs(tmp_path / "convs.jsonl")
    out = tmp_path / "prep"
    cfg = ROOT / "configs" / "prepare-smollm2.yaml"
    rc = main(
        [
            "prepare",
            "--config",
            str(cfg),
            f"target={tiny_dir}",
            f"data={data}",
            f"output_dir={out}",
            "num_conversations=0",
            "max_length=64",
            "draft_vocab_size=20",
            "shard_mb=0.01",
            "progress=false",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "12 conversations" in printed and "1 malformed skipped" in printed and f"{data}:6" in printed
    assert "capture needs" in printed and "capture complete" in printed
    ds = FeatureDataset(out)
    assert len(ds) == 12 and len(ds.manifest["shards"]) > 1
    assert ds.manifest["sample_ids"] == [f"c{i}" for i in range(12)]
    d2t, t2d = load_draft_vocab(out)
    assert d2t.numel() == 20 and t2d.numel() == 64
    assert main(["prepare", "--config", str(cfg), "no_such_key=1"]) == 2  # one line, exit 2
    assert "eaglekit: error: " in capsys.readouterr().err


def _greedy(target, messages, max_new_tokens):
    tok = target.tokenizer
    ids = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
        return_tensors="pt",
    )["input_ids"]
    out = target.model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_regeneration_rewrites_answers_and_resumes(tmp_path, monkeypatch):
    from helpers import tiny_target

    from eaglekit.data_prep import regenerate as regen

    target = tiny_target()
    convs = read_conversations(write_convs(tmp_path / "c.jsonl", 7))
    cfg = RegenerateConfig(enabled=True, max_new_tokens=6, batch_size=2, sort_window=2)  # windows of 4, 3
    batches, batch_fn = [], regen.regenerate_batch
    monkeypatch.setattr(regen, "regenerate_batch", lambda t, cs, c, seed: batches.append([x["id"] for x in cs])
                        or batch_fn(t, cs, c, seed))
    full = regenerate(target, convs, tmp_path / "full.jsonl", cfg, progress=False)
    # each window's conversations go shortest first prompt first ("hello " * (i % 3 + 1)); stable on ties
    assert batches == [["c0", "c3"], ["c1", "c2"], ["c6", "c4"], ["c5"]]
    got = [json.loads(line) for line in full.read_text().splitlines()]
    assert [g["id"] for g in got] == [c["id"] for c in convs]
    for g, c in zip(got, convs):  # user turns kept, assistant turns replaced by the target's own answers
        assert [m for m in g["messages"] if m["role"] == "user"] == [
            m for m in c["messages"] if m["role"] == "user"
        ]
        assert len(g["messages"]) == len(c["messages"])
    c0 = convs[0]["messages"]
    first = _greedy(target, c0[:1], 6)
    assert got[0]["messages"][1]["content"] == first  # batched + left-padded = the target's own greedy answer
    assert got[0]["messages"][3]["content"] == _greedy(
        target, [c0[0], {"role": "assistant", "content": first}, c0[2]], 6
    )
    # sorting moves no answer: unsorted batches write the same file
    assert regenerate(target, convs, tmp_path / "unsorted.jsonl", RegenerateConfig(
        enabled=True, max_new_tokens=6, batch_size=2, sort_window=1), progress=False).read_bytes() == full.read_bytes()
    # a run killed mid-write: one whole window, part of the next, a torn line → resumes from the second window
    lines = full.read_bytes().split(b"\n")
    part = tmp_path / "part.jsonl"
    part.write_bytes(b"\n".join(lines[:5]) + b"\n" + lines[5][:10])
    batches.clear()
    regenerate(target, convs, part, cfg, progress=False)
    assert part.read_bytes() == full.read_bytes() and batches == [["c6", "c4"], ["c5"]]
    regenerate(target, convs, part, cfg, progress=False)  # a finished file (7 = 4 + 3) is left as it is
    assert part.read_bytes() == full.read_bytes() and len(batches) == 2
    with pytest.raises(ValueError, match="other conversations"):
        regenerate(target, convs[1:], part, cfg, progress=False)
    # two ranks (every other window each, then a merge) write exactly the one-process file
    two = tmp_path / "two.jsonl"
    regenerate(target, convs, two, cfg, progress=False, rank=1, world_size=2, wait=False)
    assert not two.exists() and (tmp_path / "two.part1-of-2.jsonl").exists()
    regenerate(target, convs, two, cfg, progress=False, rank=0, world_size=2)
    assert two.read_bytes() == full.read_bytes() and not list(tmp_path.glob("two.part*"))
    # temperature > 0 samples (differs from greedy) and is reproducible from the seed
    hot = RegenerateConfig(enabled=True, max_new_tokens=6, batch_size=2, sort_window=2, temperature=1.0, seed=1)
    a = regenerate(target, convs, tmp_path / "hot-a.jsonl", hot, progress=False).read_text()
    b = regenerate(target, convs, tmp_path / "hot-b.jsonl", hot, progress=False).read_text()
    assert a == b and a != full.read_text()


KILL_SCRIPT = r"""
import sys, time, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]
torch.set_num_threads(int(sys.argv[3]))
from helpers import tiny_target
from test_data_prep_capture import tiny_samples
from eaglekit.data_prep import capture_features

t = tiny_target()
def slow(j):
    print("shard", j, flush=True)
    time.sleep(float(sys.argv[4]))
capture_features(t, tiny_samples(t.tokenizer), sys.argv[2], shard_tokens=60, progress=False, on_shard=slow)
print("done", flush=True)
"""


def test_kill_9_mid_capture_then_resume_equals_uninterrupted(tmp_path):
    from helpers import tiny_target
    from test_data_prep_capture import tiny_samples

    from eaglekit.data_prep import capture_features

    t = tiny_target()
    ref = capture_features(t, tiny_samples(t.tokenizer), tmp_path / "ref", shard_tokens=60, progress=False)
    assert len(ref["shards"]) >= 8
    script = tmp_path / "cap.py"
    script.write_text(KILL_SCRIPT)
    args = [
        sys.executable,
        str(script),
        str(Path(__file__).parent),
        str(tmp_path / "run"),
        str(torch.get_num_threads()),
    ]
    proc = subprocess.Popen(args + ["0.3"], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    for line in proc.stdout:
        if line.startswith("shard 2"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not json.loads((tmp_path / "run" / "manifest.json").read_text())["complete"]
    written = sorted(p.name for p in (tmp_path / "run").glob("shard-*.safetensors"))
    assert 3 <= len(written) < len(ref["shards"])
    resumed = []  # rerun (in this process, same thread count): starts at the first missing shard
    capture_features(
        t,
        tiny_samples(t.tokenizer),
        tmp_path / "run",
        shard_tokens=60,
        progress=False,
        on_shard=resumed.append,
    )
    assert resumed == list(range(len(written), len(ref["shards"])))
    for s in ref["shards"]:
        assert (tmp_path / "run" / s["file"]).read_bytes() == (tmp_path / "ref" / s["file"]).read_bytes()
    assert not list((tmp_path / "run").glob("*.tmp-*"))
    assert FeatureDataset(tmp_path / "run").manifest["complete"]


@pytest.mark.slow
def test_two_process_capture_gives_the_same_samples_as_one(tmp_path, tiny_dir):
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    data = write_convs(tmp_path / "convs.jsonl", 16)
    common = [
        "regenerate.enabled=true",
        "regenerate.max_new_tokens=4",
        "regenerate.batch_size=3",
        f"target={tiny_dir}",
        f"data={data}",
        "max_length=64",
        "draft_vocab_size=20",
        "shard_mb=0.005",
        "progress=false",
    ]
    run_prepare(load_config(PrepareConfig, None, common + [f"output_dir={tmp_path / 'one'}"]))
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": str(ROOT)}
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "eaglekit.cli",
            "prepare",
        ]
        + common
        + [f"output_dir={tmp_path / 'two'}"]
    )
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[rank 0/2]" in run.stdout and "[rank 1/2]" in run.stdout
    regenerated = (tmp_path / "one" / "regenerated.jsonl").read_text()
    assert regenerated == (tmp_path / "two" / "regenerated.jsonl").read_text()
    assert not list((tmp_path / "two").glob("*.part*"))
    one, two = FeatureDataset(tmp_path / "one"), FeatureDataset(tmp_path / "two")
    assert len(one.manifest["shards"]) >= 4
    for key in ("sample_ids", "lengths", "shards", "plan_hash"):
        assert one.manifest[key] == two.manifest[key]
    for i in range(len(one)):
        a, b = one[i], two[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for k in ("taps", "last"):
            assert torch.allclose(a[k].float(), b[k].float(), atol=1e-2, rtol=1e-2)
    # same thread count, same shard plan, same batches → each rank's shards are byte-equal to one process's
    for s in one.manifest["shards"]:
        assert (tmp_path / "one" / s["file"]).read_bytes() == (tmp_path / "two" / s["file"]).read_bytes()


def test_max_turns_keeps_first_user_turns():
    from eaglekit.data_prep.prepare import first_turns

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    assert [m["content"] for m in first_turns(msgs, 1)] == ["s", "u1", "a1"]
    assert first_turns(msgs, 2) == msgs and first_turns(msgs, 0) == msgs and first_turns(msgs, 5) == msgs


def _prepare(tiny_dir, out, data, *extra):
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    common = [f"target={tiny_dir}", f"data={data}", f"output_dir={out}", "max_length=64", "shard_mb=0.01",
              "progress=false"]
    return run_prepare(load_config(PrepareConfig, None, common + list(extra)))


def test_a_refused_prepare_writes_nothing_and_the_manifest_records_the_vocab(tmp_path, tiny_dir):
    from eaglekit.data_prep.vocab import vocab_hash

    out = tmp_path / "prep"
    _prepare(tiny_dir, out, write_convs(tmp_path / "a.jsonl", 12), "draft_vocab_size=20")
    d2t, t2d = load_draft_vocab(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["draft_vocab"] == {"file": "draft_vocab.safetensors", "sha256": vocab_hash(d2t, t2d), "size": 20}
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    other = write_convs(tmp_path / "b.jsonl", 9)
    with pytest.raises(ValueError, match=f"{out} holds a different capture"):  # other data: after tokenizing
        _prepare(tiny_dir, out, other, "draft_vocab_size=30")
    with pytest.raises(ValueError, match=f"{out} holds a different capture.*kind eagle3 vs eagle1"):
        _prepare(tiny_dir, out, other, "draft_vocab_size=30", "kind=eagle1")
    with pytest.raises(ValueError, match=f"{out} holds a capture.*capture=false would replace its draft vocab"):
        _prepare(tiny_dir, out, other, "draft_vocab_size=30", "capture=false")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # the same data with another vocabulary size resumes: the new vocabulary is recorded
    _prepare(tiny_dir, out, tmp_path / "a.jsonl", "draft_vocab_size=24")
    d2t, t2d = load_draft_vocab(out)
    assert d2t.numel() == 24
    assert json.loads((out / "manifest.json").read_text())["draft_vocab"]["sha256"] == vocab_hash(d2t, t2d)
