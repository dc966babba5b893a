"""One decode path: a step of one sequence and of a batch is the same ``loop.Decoder.step``, and it stays
short. A profiler records every eaglekit file a step enters (tiny target): a plain step, and a step of an
EAGLE-3, EAGLE-1, P-EAGLE, DFlash or DFlash 2 head's tree or chain (greedy or sampled), a draft model's chain or tree,
or prompt lookup, enters at most 7 files in all (a head's: decode/{drafters,loop}, heads/{base,<kind>,layers},
target/{model,cache}: the tree, its proposer, the parallel drafter and the catch-up live in drafters.py, sampling
and the acceptance rules in loop.py, the head's attention and cache in heads/layers.py, the target's forward and
taps in target/model.py, its KV cache in target/cache.py; P-EAGLE's class sits in heads/eagle3.py beside the
network it shares). A head with the prompt-lookup graft adds decode/lookup.py (8: two drafters in one step). decode/ keeps no single/batch twin
names."""
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_target
from test_decode_core import tiny_head

import eaglekit
from eaglekit import decode
from eaglekit.decode import loop
from eaglekit.decode.draft_model import ModelTreeDrafter
from eaglekit.decode.drafters import TreeSpec
from eaglekit.heads import HeadConfig, build_head

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(eaglekit.__file__).parent
STEP_FILES = 7  # the parts above, the target's two modules counted apart
TWINS = ("verify_batch", "keep_rows", "catch_up_together", "run_batch", "BatchDecoder", "at_rows")


def files_per_step(monkeypatch) -> list[set[str]]:
    """Patch ``Decoder.step`` to record the eaglekit files (relative to the package) each call enters."""
    seen, step = [], loop.Decoder.step

    def traced(self, *a, **k):
        files = set()

        def profile(frame, event, arg):
            if event == "call":
                name = frame.f_code.co_filename
                if name.startswith(str(ROOT)):
                    files.add(Path(name).relative_to(ROOT).as_posix())
        sys.setprofile(profile)
        try:
            return step(self, *a, **k)
        finally:
            sys.setprofile(None)
            seen.append(files)
    monkeypatch.setattr(loop.Decoder, "step", traced)
    return seen


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_plain_step_enters_at_most_seven_files(monkeypatch, rows):
    t = tiny_target()
    seen = files_per_step(monkeypatch)
    prompts = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33]][:rows]
    decode.generate(t, None, torch.tensor(prompts) if rows == 1 else prompts, 4, eos_token_id=False)
    assert seen and all("target/model.py" in s for s in seen)  # the profiler sees the target's forward
    assert max(len(s) for s in seen) <= STEP_FILES, sorted(max(seen, key=len))


def drafting(t, kind: str):
    """(drafter, generate's keywords, a file the step must enter: the drafter was traced) of one kind."""
    if kind in ("eagle3", "eagle1"):
        return tiny_head(t, kind), {"tree": TreeSpec(4, 4, 16)}, "heads/layers.py"
    if kind in ("peagle", "dflash", "dflash2"):  # DFlash 2 sits in heads/dflash.py beside DFlash
        torch.manual_seed(0)
        head = build_head(HeadConfig.from_target(t, kind=kind, num_layers=2, block_size=4), t)
        return head, {"tree": TreeSpec(3, 3, 9)}, f"heads/{'eagle3' if kind == 'peagle' else 'dflash'}.py"
    if kind == "lookup":
        return None, {"prompt_lookup": 3}, "decode/lookup.py"
    draft = tiny_target(seed=1, layers=1)
    if kind == "draft chain":
        return draft, {"gamma": 3}, "decode/draft_model.py"
    return ModelTreeDrafter(t, draft, TreeSpec(3, 3, 9)), {}, "decode/draft_model.py"


def traced_steps(monkeypatch, kind: str, rows: int, **extra) -> tuple[list[set[str]], str]:
    """(the files each step entered, the file the drafter's step must enter) for one generate of ``kind``."""
    t = tiny_target()
    drafter, kw, entered = drafting(t, kind)
    seen = files_per_step(monkeypatch)
    prompts = [[2, 8, 9, 10, 8, 9, 10, 8], [2, 20, 21], [2, 30, 31, 32, 33]][:rows]  # the first one repeats
    decode.generate(t, drafter, torch.tensor(prompts) if rows == 1 else prompts, 6, eos_token_id=False,
                    **kw, **extra)
    return seen, entered


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "peagle", "dflash", "dflash2", "draft chain", "draft tree",
                                  "lookup"])
def test_decode_drafting_step_enters_at_most_seven_files(monkeypatch, kind, rows):
    seen, entered = traced_steps(monkeypatch, kind, rows)
    assert seen and all(entered in s for s in seen)
    assert max(len(s) for s in seen) <= STEP_FILES, sorted(max(seen, key=len))


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash2", "draft chain"])  # dflash2: its sampled walk
def test_decode_sampled_step_enters_at_most_seven_files(monkeypatch, kind):
    # temperature > 0: the warpers and the acceptance rules are loop.py's, no file more than greedy
    seen, entered = traced_steps(monkeypatch, kind, 1, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert seen and all(entered in s for s in seen)
    assert max(len(s) for s in seen) <= STEP_FILES, sorted(max(seen, key=len))


def test_decode_head_with_lookup_graft_enters_eight_files(monkeypatch):
    seen, entered = traced_steps(monkeypatch, "eagle3", 1, prompt_lookup=3)
    assert seen and all(entered in s for s in seen)
    assert max(len(s) for s in seen) <= STEP_FILES + 1, sorted(max(seen, key=len))


def test_decode_has_no_single_batch_twins():
    found = {(p.name, name) for p in (ROOT / "decode").glob("*.py") for name in TWINS
             if re.search(rf"\b{name}\b", p.read_text())}
    assert found == set(), found
