"""Tensor-parallel targets (eaglekit.target.tensor_parallel) and device-map placement, on CPU with gloo.

Real processes (tests/tp_checks.py, one launch per test): Qwen2.5-Coder-0.5B split 2 ways captures the
features one process computes (fp32, within FEATURE_TOL: the split matmuls sum in another order), decodes
greedily with a head tree token for token as the split target's own greedy decoding (the near-tie rule of
test_decode_real is the only slack), regenerates answers (greedy, turn by turn, and resumed after a kill) that
are the bytes one process writes, answers through the ``eaglekit generate`` CLI with one process's greedy
tokens (``eaglekit bench`` takes tp_size the same way; tp_checks.py can run it; the suite leaves it out for time), and trains
online under DeepSpeed ZeRO-2 to the one-process head (HEAD_TOL). A tiny model at dp 2 ×
tp 2 (4 processes, DDP) runs ``eaglekit prepare`` with sampled regeneration to the files one process writes
and trains to the head one process with the same global batch trains. In one process: the refusals (launch
sizes, heads that do not divide, no TP plan), regeneration through an endpoint (the group's writer alone asks
and writes) and a capture through a device map that offloads to disk, byte-identical to the whole model's.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import accelerate_launcher, save_tiny, tiny_config, tiny_conversations, tiny_tokenizer
from safetensors.torch import load_file

from eaglekit.data_prep.capture import capture_features, compute_features
from eaglekit.target import load_target
from eaglekit.target import tensor_parallel as tp

ROOT = Path(__file__).resolve().parents[2]
QWEN = "qwen2.5-coder-0.5b-instruct"
REGEN_IDS = ["VY7cMKG_0", "i6IyJda_0", "6Zoa7wI_0", "tcgsdUu_0"]  # short ShareGPT turns; the first has 2
CLI_PROMPT = "Write a Python function that checks whether a number is prime."
FEATURE_TOL = 1e-5  # relative to the feature's largest magnitude (fp32 sums in another order, 24 layers)
HEAD_TOL = 1e-5  # the largest weight difference of the trained heads


# ---- refusals and the layout (one process) --------------------------------------------------------------
def test_layout_and_launch_refusals(monkeypatch):
    lay = tp.Layout(tp_size=2, world_size=4, rank=3)
    assert (lay.dp_size, lay.dp_rank, lay.tp_rank, lay.writes, lay.group_ranks()) == (2, 1, 1, False, [2, 3])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="this is one process: launch it with torchrun --nproc_per_node 2"):
        tp.launch_layout(2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="does not divide the launch's 3 processes"):
        tp.launch_layout(2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="needs exactly 2 processes; the launch has 4"):
        tp.launch_layout(2, only_tp=True)
    assert tp.launch_layout(2) == tp.Layout(2, 4, 2)


def test_models_that_cannot_be_split_are_refused_before_loading(monkeypatch, tmp_path):
    cfg = tiny_config("qwen2")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="does not divide its num_key_value_heads=2"):
        tp.check_model(cfg, 4, "tiny")
    with pytest.raises(ValueError, match="does not divide its num_attention_heads=4"):
        tp.check_model(cfg, 3, "tiny")
    cfg.base_model_tp_plan = None
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        tp.check_model(cfg, 2, "tiny")
    tp.check_model(tiny_config("qwen2"), 2, "tiny")  # divides: no error
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    save_tiny(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, hidden=48)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):  # no process group, no weights read
        load_target(tmp_path / "m", tp_size=2)


def test_generate_refuses_what_processes_could_decide_apart():
    from eaglekit.decode.cli import GenerateConfig, check_split

    with pytest.raises(ValueError, match="tree=auto sizes the tree from costs each process measures"):
        check_split(GenerateConfig(tp_size=2, prompt="hi"))
    with pytest.raises(ValueError, match="give prompt="):
        check_split(GenerateConfig(tp_size=2, tree="3,4,10"))
    check_split(GenerateConfig(tp_size=2, tree="3,4,10", prompt="hi"))
    check_split(GenerateConfig())  # one process: anything goes


def test_endpoint_regeneration_on_a_split_target_is_asked_and_written_by_the_writer_alone(tmp_path):
    """With regenerate.endpoint the server needs no split forward: the TP group's first process asks it and
    writes the file one process writes; the group's other processes send nothing and write nothing."""
    sys.path.insert(0, str(ROOT / "tests/data_prep"))
    from test_data_prep_regenerate_endpoint import FakeServer, conversations

    from eaglekit.data_prep.regenerate import RegenerateConfig, regenerate

    server, convs = FakeServer(), conversations()
    try:
        cfg = RegenerateConfig(endpoint=server.url, batch_size=3, concurrency=2)
        one = regenerate(None, convs, tmp_path / "one.jsonl", cfg, progress=False).read_bytes()
        asked = len(server.bodies)
        split = SimpleNamespace(tokenizer=tiny_tokenizer(), layout=tp.Layout(tp_size=2, world_size=2, rank=1))
        regenerate(split, convs, tmp_path / "tp.jsonl", cfg, progress=False, wait=False)
        assert len(server.bodies) == asked and not (tmp_path / "tp.jsonl").exists()
        split.layout = tp.Layout(tp_size=2, world_size=2, rank=0)
        regenerate(split, convs, tmp_path / "tp.jsonl", cfg, progress=False)
        assert (tmp_path / "tp.jsonl").read_bytes() == one and len(server.bodies) == 2 * asked
    finally:
        server.close()


# ---- a device map that offloads to disk (one process) ---------------------------------------------------
def test_device_map_offload_capture_is_byte_identical(tmp_path):
    path = save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=6)
    samples = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [0] * 2 + [1] * (n - 2)} for n in (9, 14, 20, 7)]
    whole = load_target(path)
    spread = load_target(path, device_map="auto", max_memory={"cpu": "40KiB"}, offload_folder=str(tmp_path / "off"))
    places = set(spread.model.hf_device_map.values())
    assert "disk" in places, places  # the cap forces weights out of memory: offload really happens
    assert spread.device == torch.device("cpu")
    a = capture_features(whole, samples, tmp_path / "a", shard_tokens=20, progress=False)
    b = capture_features(spread, samples, tmp_path / "b", shard_tokens=20, progress=False)
    assert a["complete"] and len(a["shards"]) > 1
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


# ---- real processes ---------------------------------------------------------------------------------------
def _torchrun(processes: int, out: Path, *checks: str, timeout: int = 400, deepspeed: bool = False) -> None:
    """One launch of tests/tp_checks.py running ``checks``: torchrun (training: DDP over gloo), or with
    ``deepspeed`` accelerate launch with the ZeRO-2 CPU config (training: DeepSpeed ZeRO-2, client AdamW)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TP": "2", "ACCELERATE_USE_CPU": "1"}
    # --standalone: a rendezvous on a free port, not the default 29500 that anything else may hold
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    if deepspeed:  # ACCELERATE_USE_CPU would silently turn DeepSpeed into plain DDP
        del env["ACCELERATE_USE_CPU"]
        launcher = accelerate_launcher(str(ROOT / "configs/accelerate/cpu-zero2-2proc.yaml"), processes)
    cmd = [*launcher, str(ROOT / "tests/tp_checks.py"), str(out), *checks]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    print(r.stdout[-2000:])  # each check's time (pytest -s shows it)


def _said(out: Path, check: str, processes: int) -> list[dict]:
    return [json.loads((out / f"{check}-rank{r}.json").read_text()) for r in range(processes)]


def _train_overrides(target: str, conversations: str, out: Path, **extra) -> list[str]:
    ov = {"target": target, "data.conversations": conversations, "data.eval_samples": 2, "head.kind": "eagle3",
          "head.draft_vocab_size": 256, "optim.max_steps": 3, "optim.lr": 3e-3, "optim.warmup_steps": 1,
          "loss.ttt_steps": 2, "data.batch_size": 2, "progress": "false", "trackers": "[]", "save_interval": 0,
          "eval_interval": 0, "output_dir": str(out), **extra}
    return [f"{k}={v}" for k, v in ov.items()]


def _one_process_head(overrides: list[str]) -> dict:
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    cfg = load_train_config(None, overrides)
    train(cfg)
    return load_file(str(Path(cfg.output_dir) / "final/model.safetensors"))


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.real
def test_qwen_split_two_ways_captures_decodes_regenerates_and_trains_as_one_process(qwen05, tmp_path):
    from tp_checks import REGEN_GREEDY

    from eaglekit.data_prep.conversations import load_sharegpt
    from eaglekit.data_prep.prepare import first_turns
    from eaglekit.data_prep.regenerate import RegenerateConfig, regenerate
    from eaglekit.data_prep.template import tokenize_conversations
    from eaglekit.heads import HeadConfig, build_head, save_head

    convs = tmp_path / "convs.jsonl"
    with open(convs, "w") as fh:
        fh.writelines(json.dumps(c) + "\n" for c in list(load_sharegpt(limit=24)))
    samples, _ = tokenize_conversations(qwen05.tokenizer, [json.loads(x) for x in convs.read_text().splitlines()],
                                        max_length=48)
    samples = samples[:4]
    (tmp_path / "samples.json").write_text(json.dumps([{k: v.tolist() if torch.is_tensor(v) else v for k, v in s.items()}
                                                       for s in samples]))
    # float64: fp32's other summation order would flip bf16 roundings of the features, and Adam's first steps
    # turn any flipped gradient sign into a full lr-sized move; in float64 the split target is exact enough
    train_tp = _train_overrides(QWEN, str(convs), tmp_path / "train-tp",
                                **{"data.max_length": 40, "target.dtype": "float64", "optim.max_steps": 2,
                                   "save_interval": 1, "keep_last": 0})
    (tmp_path / "train.json").write_text(json.dumps(train_tp))
    by_id = {c["id"]: c for c in load_sharegpt(limit=40)}
    regen = [{**by_id[i], "messages": first_turns(by_id[i]["messages"], 2)} for i in REGEN_IDS]
    (tmp_path / "regen.jsonl").write_text("".join(json.dumps(c) + "\n" for c in regen))
    torch.manual_seed(0)  # an untrained EAGLE-3 head for the CLI: its drafts are checked, never trusted
    save_head(build_head(HeadConfig.from_target(qwen05, kind="eagle3", aux_layer_ids=[0, 1, 23]), qwen05),
              tmp_path / "head")
    cli = [f"target={QWEN}", f"head={tmp_path / 'head'}", "tree=3,4,10", "max_new_tokens=12", f"prompt={CLI_PROMPT}"]
    (tmp_path / "generate.json").write_text(json.dumps(cli))
    out = tmp_path / "out"
    _torchrun(2, out, "capture", QWEN, str(tmp_path / "samples.json"),
              "decode", QWEN, "Write a Python function that reverses a list, and explain it.",
              "regenerate", QWEN, str(tmp_path / "regen.jsonl"), "generate", str(tmp_path / "generate.json"),
              "train", str(tmp_path / "train.json"), deepspeed=True)

    # capture: fp32 features as one process computes them; the shards hold their bf16, written by one process
    ours, ref = torch.load(out / "features-tp.pt"), compute_features(qwen05, samples, dtype=torch.float32)
    for key in ("taps", "last"):
        scale = max(r[key].abs().max().item() for r in ref)
        worst = max((o[key] - r[key]).abs().max().item() for o, r in zip(ours, ref)) / scale
        print(f"{key}: TP=2 features differ from one process by {worst:.2e} of their largest magnitude")
        assert 0 < worst < FEATURE_TOL, f"{key}: TP features differ from one process by {worst:.2e} of their scale"
    said = _said(out, "capture", 2)
    assert [s["layout"] for s in said] == [[0, 0], [0, 1]] and said[0]["complete"] and not said[1]["complete"]
    assert {s["lm_head_weight"] for s in said} == {"DTensor"} and {s["borrowed_weight"] for s in said} == {"Parameter"}
    manifest = json.loads((out / "capture/manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 1
    shards = [load_file(str(out / "capture" / s["file"])) for s in manifest["shards"]]
    assert torch.equal(torch.cat([s["taps"] for s in shards]), torch.cat([o["taps"] for o in ours]).to(torch.bfloat16))

    # decode: token for token the split target's own greedy decoding, the same on both processes
    said = _said(out, "decode", 2)
    assert said[0]["tokens"] == said[1]["tokens"] and all(s["near_ties"] <= 1 for s in said)
    assert said[0]["tau"] > 1  # prompt lookup accepted some drafts: the KV rollback under TP was exercised

    # regeneration: the bytes one process writes (fp32, greedy), written by the first process alone; resumed
    # after a kill, it regenerates only the batch it had not finished
    one = regenerate(qwen05, regen, tmp_path / "regen-one/regenerated.jsonl", RegenerateConfig(**REGEN_GREEDY),
                     progress=False).read_bytes()
    lines = [json.loads(x) for x in one.splitlines()]
    assert [x["id"] for x in lines] == REGEN_IDS and all(len(x["messages"]) >= 2 for x in lines)
    assert len(lines[0]["messages"]) == 4  # a second turn, regenerated on the first turn's new answer
    for run in ("greedy", "resumed"):
        assert sorted(p.name for p in (out / f"regen-{run}").iterdir()) == ["regenerated.jsonl"]
        assert (out / f"regen-{run}/regenerated.jsonl").read_bytes() == one, run
    said = _said(out, "regenerate", 2)
    assert said[0]["generated"] == said[1]["generated"] == {"greedy": REGEN_IDS[::2], "resumed": REGEN_IDS[2:3]}

    # eaglekit generate at tp_size=2: what it prints is one process's greedy answer
    ids = qwen05.chat_ids(CLI_PROMPT)
    ref = qwen05.model.generate(ids, max_new_tokens=12, do_sample=False, temperature=None, top_p=None, top_k=None)
    said = _said(out, "generate", 2)
    assert [s["code"] for s in said] == [0, 0] and said[1]["printed"] == ""  # the first process speaks
    assert said[0]["printed"].strip() == qwen05.tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip()

    # online training under DeepSpeed ZeRO-2 (the tiny dp 2 x tp 2 test trains with DDP): the one-process head,
    # within HEAD_TOL
    assert {(s["processes"], s["distributed_type"]) for s in _said(out, "train", 2)} == {(2, "DEEPSPEED")}
    one = _one_process_head([o for o in train_tp if not o.startswith("output_dir=")]
                            + [f"output_dir={tmp_path / 'train-one'}"])
    moved = _largest_difference(one, load_file(str(tmp_path / "train-tp/final/model.safetensors")))
    print(f"online training: the TP=2 head differs from one process's by {moved:.2e}")
    assert moved < HEAD_TOL, f"TP=2 head differs from one process by {moved:.2e}"
    first = {k.removeprefix("head."): v for k, v in
             load_file(str(tmp_path / "train-tp/checkpoints/step-1/model.safetensors")).items()}
    assert _largest_difference(first, one) > 100 * HEAD_TOL  # the second step moved the head: equality is not idle


@pytest.mark.slow
def test_tiny_dp2_tp2_trains_the_one_process_head(tmp_path):
    save_tiny(tmp_path / "tiny", arch="qwen2", vocab_size=64, hidden=32, layers=6)
    tiny_conversations(tmp_path / "convs.jsonl", n=24)
    base = _train_overrides(str(tmp_path / "tiny"), str(tmp_path / "convs.jsonl"), tmp_path / "tp",
                            **{"head.draft_vocab_size": 40, "data.eval_samples": 4})
    (tmp_path / "train.json").write_text(json.dumps(base))
    prep = [f"target={tmp_path / 'tiny'}", f"data={tmp_path / 'convs.jsonl'}", "draft_vocab_size=40", "shard_mb=0.01",
            "progress=false", "regenerate.enabled=true", "regenerate.temperature=0.9", "regenerate.max_new_tokens=10",
            "regenerate.batch_size=4"]  # sampled: each TP group's processes draw the same tokens
    (tmp_path / "prepare.json").write_text(json.dumps(prep + [f"output_dir={tmp_path / 'prep-tp'}"]))
    _torchrun(4, tmp_path / "out", "prepare", str(tmp_path / "prepare.json"), "train", str(tmp_path / "train.json"))
    assert {(s["processes"], s["distributed_type"]) for s in _said(tmp_path / "out", "train", 4)} == {(4, "MULTI_CPU")}

    # the capture at dp 2 x tp 2: the files one process writes (bf16 features within one rounding step),
    # after the same sampled answers (the groups' parts merged in batch order, no part left behind)
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    run_prepare(load_config(PrepareConfig, None, prep + [f"output_dir={tmp_path / 'prep-one'}"]))
    regenerated = [(tmp_path / d / "regenerated.jsonl").read_text() for d in ("prep-one", "prep-tp")]
    assert regenerated[0] == regenerated[1] and not list((tmp_path / "prep-tp").glob("*.part*"))
    answers = {m[-1]["content"] for x in regenerated[0].splitlines() if (m := json.loads(x)["messages"])}
    assert len(answers) > 12  # most of the 24 conversations got an answer of their own
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("prep-one", "prep-tp"))
    assert b["complete"] and len(b["shards"]) >= 4 and a["plan_hash"] == b["plan_hash"]
    for sh in a["shards"]:
        x, y = (load_file(str(tmp_path / d / sh["file"])) for d in ("prep-one", "prep-tp"))
        for key in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(x[key], y[key])
        for key in ("taps", "last"):
            torch.testing.assert_close(x[key].float(), y[key].float(), rtol=2**-7, atol=1e-6)
    v1, v2 = (load_file(str(tmp_path / d / "draft_vocab.safetensors")) for d in ("prep-one", "prep-tp"))
    assert v1.keys() == v2.keys() and all(torch.equal(v1[k], v2[k]) for k in v1)
    # one process, the same global batch: 2 micro-batches per step (one per TP group there)
    one = _one_process_head([o for o in base if not o.startswith("output_dir=")]
                            + [f"output_dir={tmp_path / 'one'}", "optim.grad_accum=2"])
    half = _one_process_head([o for o in base if not o.startswith("output_dir=")] + [f"output_dir={tmp_path / 'half'}"])
    tp_head = load_file(str(tmp_path / "tp/final/model.safetensors"))
    assert _largest_difference(one, tp_head) < HEAD_TOL
    assert _largest_difference(half, tp_head) > 100 * HEAD_TOL  # half the batch gives another head: not trivial
