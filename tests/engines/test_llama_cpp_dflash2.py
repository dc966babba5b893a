"""A DFlash 2 head served by the pinned llama-server (``--spec-type draft-dflash``; llama.cpp detects DFlash 2
by the GGUF's selector_top_k and walks the selector greedily), exported with ``export --to llama.cpp`` (the HF
layout with the nested dflash_config, through the pinned converter): greedy output identical to plain
llama-server, and what the server accepts within 3% of eaglekit's own drafting of the same head replayed on
those outputs (2026-12-05, 12 epochs: 67 of 250 drafted tokens accepted by the server, 68 by eaglekit; τ 1.753
and 1.773; 20 epochs gave 93 of 177 at ~1.5x the test's time)."""
import pytest
from helpers import fit_head
from test_llama_cpp import serve_like_plain_and_replay, served  # noqa: F401 (served: plain llama-server's answers)

from eaglekit.export import load_head


@pytest.mark.real
@pytest.mark.slow  # ~1 min with a built llama.cpp (the head's fit: ~25 s)
def test_llama_cpp_real_server_drafts_with_a_dflash2_head(smollm2, served, tmp_path):  # noqa: F811
    fitted = fit_head(smollm2, served[4], tmp_path / "fit", "head.kind=dflash2", "head.block_size=4",
                      "head.num_layers=1", f"head.draft_vocab_size={smollm2.vocab_size}", "head.selector_rank=64",
                      "head.init_from_target=true", "optim.epochs=12")
    head = load_head(fitted, smollm2)
    assert head.config.kind == "dflash2" and float(head.candidate_selector.successor_codebook.detach().abs().max()) > 0
    outs, reps = serve_like_plain_and_replay(smollm2, head, served, tmp_path, "draft-dflash")
    server, ours = sum(o.accepted for o in outs), sum(r["accepted"] for r in reps)
    assert abs(server - ours) <= 0.03 * ours, ([o.accepted for o in outs], [r["accepted"] for r in reps])
    assert server / sum(o.draft_n for o in outs) > 0.15
    print(f"dflash2 on llama-server: accepted {server} of {sum(o.draft_n for o in outs)} drafted, tau "
          f"{sum(len(o.tokens) - 1 for o in outs) / sum(o.steps for o in outs):.3f}; eaglekit's replay accepted "
          f"{ours}, tau {sum(len(o.tokens) - 1 for o in outs) / sum(r['steps'] for r in reps):.3f}")
