"""One decode path: a step of one sequence and of a batch is the same ``loop.Decoder.step``, and it stays
short. A profiler records every eaglekit file a step enters (tiny target): a plain step enters at most 6 files
in all, an EAGLE-3 tree step at most 9 (decode/{drafters,loop}, heads/{base,eagle3,layers}, target,
timing: a head's proposer and catch-up live in drafters.py, its attention and cache in heads/layers.py);
decode/ keeps no single/batch twin names."""
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
from eaglekit.decode.drafters import TreeSpec

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(eaglekit.__file__).parent
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
def test_decode_plain_step_enters_at_most_six_files(monkeypatch, rows):
    t = tiny_target()
    seen = files_per_step(monkeypatch)
    prompts = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33]][:rows]
    decode.generate(t, None, torch.tensor(prompts) if rows == 1 else prompts, 4, eos_token_id=False)
    assert seen and all("target.py" in s for s in seen)  # the profiler sees the target's forward
    assert max(len(s) for s in seen) <= 6, sorted(max(seen, key=len))


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_head_step_enters_at_most_nine_files(monkeypatch, rows):
    t = tiny_target()
    head = tiny_head(t, "eagle3")
    seen = files_per_step(monkeypatch)
    prompts = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33]][:rows]
    decode.generate(t, head, torch.tensor(prompts) if rows == 1 else prompts, 6, eos_token_id=False,
                    tree=TreeSpec(4, 4, 16))
    assert seen and all({"decode/drafters.py", "heads/layers.py"} <= s for s in seen)  # the head was traced
    assert max(len(s) for s in seen) <= 9, sorted(max(seen, key=len))


def test_decode_has_no_single_batch_twins():
    found = {(p.name, name) for p in (ROOT / "decode").glob("*.py") for name in TWINS
             if re.search(rf"\b{name}\b", p.read_text())}
    assert found == set(), found
