"""`eaglekit generate` and `eaglekit bench` end to end on saved tiny models (seconds)."""
import json

import pytest
from helpers import save_tiny

from eaglekit.cli import dispatch, main  # dispatch raises where main prints one line

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from test_decode_core import tiny_head

    root = tmp_path_factory.mktemp("decode_cli")
    target_dir = save_tiny(root / "target", layers=3, max_position_embeddings=4096)  # MT-bench in chars
    draft_dir = save_tiny(root / "draft", seed=1, layers=2, max_position_embeddings=4096)
    from eaglekit.target import load_target

    head = tiny_head(load_target(str(target_dir)), "eagle3", 48)
    head.save_pretrained(root / "head")
    return target_dir, draft_dir, root / "head"


def test_decode_cli_generate_streams_and_prints_tau(saved, capsys, monkeypatch):
    target_dir, draft_dir, head_dir = saved
    assert main(["generate", f"target={target_dir}", f"head={head_dir}", "prompt=hello", "max_new_tokens=6",
                 "tree=2,2,3"]) == 0
    err = capsys.readouterr().err
    assert "tau=" in err and "6 tokens" in err and "(head + prompt lookup 2,5,10)" in err  # auto: on with a head
    assert main(["generate", f"target={target_dir}", "prompt=hello", "max_new_tokens=3"]) == 0
    assert "(plain)" in capsys.readouterr().err  # auto: off without a drafter
    import sys

    from eaglekit.decode.lookup import LookupDrafter

    built = []  # the CLI's prompt_lookup reaches generate()
    monkeypatch.setattr(sys.modules["eaglekit.decode.api"], "LookupDrafter",
                        lambda inner, n, **kw: built.append(n) or LookupDrafter(inner, n, **kw))
    assert main(["generate", f"target={target_dir}", f"head={head_dir}", "prompt=hello hello", "max_new_tokens=6",
                 "tree=2,2,3", "prompt_lookup=3"]) == 0
    assert "(head + prompt lookup 3)" in capsys.readouterr().err and built == [3]
    assert main(["generate", f"target={target_dir}", f"head={head_dir}", "prompt=hello hello", "max_new_tokens=6",
                 "tree=2,2,3", "prompt_lookup=2,5,10"]) == 0  # lengths per match length, as text
    assert built[-1] == "2,5,10" and LookupDrafter(None, built[-1]).lengths == (2, 5, 10)
    with pytest.raises(ValueError, match="prompt lookup"):  # a bad value, before any model loads
        dispatch(["generate", "target=/nonexistent", "prompt=hi", "prompt_lookup=2,5"])
    with pytest.raises(ValueError, match="draft-model chain"):  # refused before any model loads
        dispatch(["generate", f"target={target_dir}", f"draft={draft_dir}", "prompt=hi", "prompt_lookup=3"])
    assert main(["generate", f"target={target_dir}", f"draft={draft_dir}", "prompt=hi", "max_new_tokens=5",
                 "temperature=0.8"]) == 0
    assert "draft model, gamma=4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tree="):
        dispatch(["generate", f"target={target_dir}", "prompt=hi", "tree=big"])


def test_decode_cli_bench_writes_json_with_baselines(saved, tmp_path):
    target_dir, draft_dir, _ = saved
    assert main(["bench", f"target={target_dir}", f"draft={draft_dir}", "prompts=2", "max_new_tokens=6",
                 "repeats=1", "temperatures=[0.0]", "assistant_tokens=[3]", f"out={tmp_path}"]) == 0
    (path,) = tmp_path.glob("*.json")
    res = json.loads(path.read_text())["results"]["0.0"]
    assert set(res) == {"plain", "ours", "hf", "hf_lookup", "hf_assisted_3"}
    assert res["plain"]["speedup_vs_plain"] == 1.0 and res["ours"]["tau"] >= 1.0
    assert all(r["repeats"][0]["tokens"] == 12 for r in res.values())  # eos of the tiny model is rare
    # greedy: every method reproduces plain decoding token for token (fp32 tiny model: no ties)
    assert all(r["identical_to_plain"] == "2/2" for r in res.values()), {n: r["identical_to_plain"] for n, r in res.items()}


def test_decode_cli_bench_with_lookup(saved, tmp_path):
    target_dir, _, head_dir = saved
    assert main(["bench", f"target={target_dir}", f"head={head_dir}", "prompts=2", "max_new_tokens=8", "repeats=1",
                 "temperatures=[0.0]", "tree=2,2,3", "lookup_tokens=3", "hf_baselines=false", f"out={tmp_path}"]) == 0
    (path,) = tmp_path.glob("*.json")
    res = json.loads(path.read_text())["results"]["0.0"]
    assert set(res) == {"plain", "ours", "lookup", "ours_lookup"}
    assert res["lookup"]["tau"] > 1.0  # lookup's drafts were accepted (the tiny model repeats itself)
    assert all(r["identical_to_plain"] == "2/2" for r in res.values()), {n: r["identical_to_plain"] for n, r in res.items()}


def test_decode_cli_bench_auto_tree_with_lookup_lengths(saved, tmp_path, monkeypatch):
    """tree=auto (planned once) with lookup lengths by match: the plan's head share beside a branch is
    used by ours_lookup only; every method still reproduces plain decoding."""
    from eaglekit.decode import Plan, TreeSpec
    from eaglekit.decode import cost as planner

    target_dir, _, head_dir = saved
    plan = Plan(TreeSpec(depth=2, top_k=2, total_tokens=3), expected_tokens_per_s=30.0, plain_tokens_per_s=20.0,
                nodes_with_lookup=1)
    monkeypatch.setattr(planner, "auto_plan", lambda target, head: plan)
    import sys

    from eaglekit.decode.lookup import LookupDrafter

    shares = []  # inner_nodes of every LookupDrafter the bench's generate() calls build
    monkeypatch.setattr(sys.modules["eaglekit.decode.api"], "LookupDrafter",
                        lambda inner, n, **kw: shares.append(kw["inner_nodes"]) or LookupDrafter(inner, n, **kw))
    assert main(["bench", f"target={target_dir}", f"head={head_dir}", "prompts=2", "max_new_tokens=8", "repeats=1",
                 "temperatures=[0.0]", "lookup_tokens=2,5,10", "hf_baselines=false", f"out={tmp_path}"]) == 0
    assert set(shares) == {None, 1}  # "lookup" (no head) has none; "ours_lookup" gets the plan's 1
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    assert report["tree"] == "TreeSpec(depth=2, top_k=2, total_tokens=3)" and report["nodes_with_lookup"] == 1
    res = report["results"]["0.0"]
    assert set(res) == {"plain", "ours", "lookup", "ours_lookup"}
    assert all(r["identical_to_plain"] == "2/2" for r in res.values()), {n: r["identical_to_plain"] for n, r in res.items()}


def test_decode_cli_bench_split_target_refusals(saved):
    """tp_size > 1: tree=auto is refused before any model loads (each process would time its own costs and
    could pick another tree), and a launch of one process is refused naming torchrun."""
    target_dir, _, head_dir = saved
    with pytest.raises(ValueError, match="tree=auto sizes the tree from costs each process measures"):
        dispatch(["bench", "target=/nonexistent", "head=/nonexistent", "tp_size=2"])
    with pytest.raises(ValueError, match="this is one process: launch it with torchrun --nproc_per_node 2"):
        dispatch(["bench", f"target={target_dir}", f"head={head_dir}", "tp_size=2", "tree=2,2,3"])


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_decode_cli_dtype_names_are_configs_one_list(command):
    """Both CLIs take the dtype names config.Dtype lists (float64 included), refused with its one message."""
    import typing

    from eaglekit.config import Dtype

    names = ", ".join(repr(n) for n in typing.get_args(Dtype))
    assert "'float64'" in names
    with pytest.raises(ValueError, match=f"dtype must be one of {names}, got 'float8'"):
        dispatch([command, "target=/nonexistent", "dtype=float8"] + (["prompt=hi"] if command == "generate" else []))
