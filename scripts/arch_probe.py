"""Probe every causal-LM type transformers maps (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) with one generic tiny config:
does it build and run a forward, and does eaglekit then capture its taps and train a head on them? Writes a JSON
record per type and prints the counts (docs/inputs.md quotes them).

    .venv/bin/python scripts/arch_probe.py [--out probe.json] [type ...]

"Trains" means: ``Target`` finds its layers and lm_head and two optimizer steps of an EAGLE-3 head on the captured
features give a finite loss and move its weights. Recorded beside it: whether the taps equal the layer inputs
``output_hidden_states`` lists (where the model lists them) and whether ``lm_head(last)`` gives the model's logits
(not where the lm_head scales them). "Plain" means eaglekit's plain
decoding gives transformers' greedy tokens; "speculative" what the loop verifies on it: "trees" (eaglekit's
cache), "chains" (the model's own cache, its states rolled back: chains in one row, trees a row per path) or
nothing (refused at its start). The probe does not decode
speculatively: tests/target/test_model_architectures.py and test_families.py show exactness on their matrices. Types whose tiny config does not build, or whose forward fails on
ids alone (encoder-decoders' decoders, models needing other inputs), are counted as not probed.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHRINK = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 512, "head_dim": 16, "moe_intermediate_size": 32,
          "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "max_position_embeddings": 256, "shared_expert_intermediate_size": 32, "word_embed_proj_dim": 64}
LAYERS = 4


def tiny_config(model_type: str):
    """transformers' default config of ``model_type`` shrunk: the sizes above where it has them, per-layer lists cut
    to ``LAYERS``."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    text = cfg.get_text_config()
    old = getattr(text, "num_hidden_layers", None)
    before = text.to_dict()
    for key, value in SHRINK.items():
        if key in before or hasattr(text, key):
            try:
                setattr(text, key, LAYERS if key == "num_hidden_layers" else value)
            except Exception:  # noqa: BLE001, S110 - a validated field that refuses the value keeps its default
                pass
    for key, value in before.items():
        if isinstance(value, list) and old and len(value) == old:
            setattr(text, key, value[:LAYERS])
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(text, key, None), int) and getattr(text, key) >= SHRINK["vocab_size"]:
            setattr(text, key, 0)
    return cfg


class Timeout(Exception):
    pass


def probe(model_type: str) -> dict:
    from helpers import tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from eaglekit import decode
    from eaglekit.heads import HeadConfig, build_head
    from eaglekit.heads.objectives import Teacher
    from eaglekit.target import Target
    from eaglekit.train.config import LossConfig

    rec = {"type": model_type}
    try:
        cfg = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        vocab = model.get_output_embeddings().weight.shape[0]
        ids = torch.randint(3, min(vocab, 512), (1, 12))
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    except Exception as e:  # noqa: BLE001 - the probe records why
        return {**rec, "forward": False, "why": f"{type(e).__name__}: {str(e)[:160]}"}
    rec["forward"] = True
    try:
        t = Target(model, tiny_tokenizer(max(vocab, 64)), name=model_type)
        feats = t.features(ids, layer_ids=range(t.num_layers))
        logits = model(input_ids=ids).logits
        rec["last_is_lm_head_input"] = bool(torch.allclose(t.lm_head(feats.last), logits, atol=1e-4, rtol=1e-4))
        H = t.hidden_size
        if hs is not None and len(hs) == t.num_layers + 1 and hs[0].shape[-1] == H:
            rec["taps_equal_hidden_states"] = all(
                torch.equal(feats.taps[..., k * H:(k + 1) * H], h.mean(-2) if h.dim() == 4 else h)
                for k, h in enumerate(hs[:t.num_layers]))
        head = build_head(HeadConfig.from_target(t, kind="eagle3", aux_layer_ids=[0, t.num_layers - 1]), t).train()
        out = t.features(torch.cat([ids, ids.flip(1)]), layer_ids=head.taps)
        batch = {"input_ids": torch.cat([ids, ids.flip(1)]), "loss_mask": torch.ones(2, 12, dtype=torch.long),
                 "last": out.last, "taps": out.taps}
        teacher, opt = Teacher.build(t.lm_head.weight, head.t2d), torch.optim.AdamW(head.parameters(), lr=1e-3)
        before = [p.detach().clone() for p in head.parameters()]
        for _ in range(2):
            loss, stats = head.training_loss(teacher, batch, LossConfig(ttt_steps=2), steps=2)
            opt.zero_grad()
            (loss / max(1, sum(stats.total))).backward()
            opt.step()
        moved = any(not torch.equal(a, p) for a, p in zip(before, head.parameters()))
        rec["trains"] = bool(torch.isfinite(loss) and moved)
        rec["speculative"] = "trees" if t.decode_refusal is None else "chains" if t.chain_refusal() is None \
            else "refused"
        rec["refusal"] = t.chain_refusal() if t.decode_refusal else None
    except Exception as e:  # noqa: BLE001
        return {**rec, "trains": False, "why": f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        rec["plain_equals_greedy"] = decode.generate(t, None, ids, 6, eos_token_id=False).sequences.tolist() == \
            ref.tolist()
    except Exception as e:  # noqa: BLE001 - transformers' own generate fails on some (recorded)
        rec.update(plain_equals_greedy=False, plain_why=f"{type(e).__name__}: {str(e)[:200]}")
    return rec


def main() -> None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ap = argparse.ArgumentParser()
    ap.add_argument("types", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=90)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    def alarm(*_):
        raise Timeout

    signal.signal(signal.SIGALRM, alarm)
    records = []
    for model_type in args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        signal.alarm(args.timeout)
        try:
            rec = probe(model_type)
        except Timeout:
            rec = {"type": model_type, "forward": False, "why": f"over {args.timeout} s"}
        signal.alarm(0)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    ran = [r for r in records if r["forward"]]
    trains = [r for r in ran if r.get("trains")]
    summary = {"transformers": transformers.__version__, "types": len(records), "forward_runs": len(ran),
               "trains": len(trains), "plain_equals_greedy": sum(bool(r.get("plain_equals_greedy")) for r in ran),
               **{f"speculative_{k}": sum(r.get("speculative") == k for r in trains)
                  for k in ("trees", "chains", "refused")},
               "not_training": {r["type"]: r.get("why", "") for r in ran if not r.get("trains")},
               # the lm_head module scales its logits (Cohere's logit_scale, a learned per-token scale): the
               # teacher, lm_head.weight @ last, differs from the model's logits by that scale
               "logits_not_lm_head_of_last": [r["type"] for r in trains if not r.get("last_is_lm_head_input")],
               "taps_differ_from_hidden_states": [r["type"] for r in trains
                                                  if r.get("taps_equal_hidden_states") is False]}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
