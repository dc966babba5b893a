"""Naive references for the DFlash head (tests only): one block recomputed from scratch with plain
attention over [context; block] keys, and the block objective summed anchor by anchor, depth by depth.

They use the head's own modules (projections, norms, embedding) but none of its composition
(``block_attention``, the cache, the batched masks, the gathers of ``training_loss``)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eaglekit.heads.layers import apply_rope


def _heads(x, n, d):
    return x.view(x.shape[0], x.shape[1], n, d).transpose(1, 2)


def naive_block_logits(head, g, ids, t: int, pos0: int = 0, hidden: bool = False) -> torch.Tensor:
    """Draft logits [D, Vd] of the block after element ``t`` of one sequence (``g`` [1, S, H] fused features,
    ``ids`` [1, S] tokens; element i sits at position pos0 + i), recomputed from scratch (DFlash's: no
    DSpark bias); ``hidden``: (the slots' final states [D, H], logits)."""
    cfg, bs = head.config, head.config.block_size
    ctx = head.hidden_norm(g[:, :t + 1])
    block = torch.full((1, bs), cfg.mask_token_id, dtype=torch.long)
    block[0, 0] = ids[0, t + 1]
    x = head.embed(block)
    cos_c, sin_c = head.rotary(pos0 + torch.arange(t + 1)[None], head.dtype)
    cos_b, sin_b = head.rotary(pos0 + t + 1 + torch.arange(bs)[None], head.dtype)
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for layer in head.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(_heads(a.q_norm(a.q_proj(h).view(1, bs, nh, d)).reshape(1, bs, -1), nh, d), cos_b, sin_b)
        k_b = apply_rope(_heads(a.k_norm(a.k_proj(h).view(1, bs, nkv, d)).reshape(1, bs, -1), nkv, d), cos_b, sin_b)
        k_c = apply_rope(_heads(a.k_norm(a.k_proj(ctx).view(1, t + 1, nkv, d)).reshape(1, t + 1, -1), nkv, d),
                         cos_c, sin_c)
        v = torch.cat([_heads(a.v_proj(ctx), nkv, d), _heads(a.v_proj(h), nkv, d)], dim=2)
        k = torch.cat([k_c, k_b], dim=2)
        rep = nh // nkv
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        x = x + a.o_proj(out.transpose(1, 2).reshape(1, bs, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    w = head.target_module("lm_head").weight[torch.arange(cfg.draft_vocab_size) + head.d2t]
    out = head.norm(x)[0, 1:]
    return (out, out @ w.T) if hidden else out @ w.T


def naive_dpace_weights(ces: dict[int, torch.Tensor], D: int, alpha: float) -> dict[int, float]:
    """D-PACE's weight of each trained depth k of one block (``ces``: depth -> its CE against the teacher),
    written out: s_k = (1 - alpha) exp(-CE_k) + alpha, w_k = sum over trained j >= k of prod_{i <= j} s_i
    (an untrained depth's s is 1)."""
    s = [(1 - alpha) * math.exp(-float(ces[k].detach())) + alpha if k in ces else 1.0 for k in range(1, D + 1)]
    return {k: sum(math.prod(s[:j]) for j in range(k, D + 1) if j in ces) for k in ces}


def naive_block_loss(head, teacher, batch, anchors, keep, scale, gamma: float, dpace_alpha: float | None = None,
                     weights_out: dict | None = None):
    """(loss, per-depth [correct, total, chain]) of the block objective, anchor by anchor; ``dpace_alpha``:
    D-PACE's weights (``naive_dpace_weights``) instead of exp(-(k-1)/gamma); ``weights_out`` gets each
    trained depth's weight by (row, anchor slot, depth)."""
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
    S, D = ids.shape[1], head.draft_depths
    g = head.fuse(batch["taps"])
    wd = teacher.draft_weight
    total = torch.zeros(())
    counts = [[0, 0, 0] for _ in range(D)]
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[b, n]:
                continue
            t = int(anchors[b, n])
            logits = naive_block_logits(head, g[b:b + 1], ids[b:b + 1], t)
            all_right, ces = True, {}
            for k in range(1, D + 1):
                if t + 1 + k >= S:
                    break
                top = int(teacher.targets(last[b:b + 1, t + k:t + k + 1], 512)[0, 0])
                right = int(logits[k - 1].argmax()) == top
                all_right = all_right and right  # decoding accepts depth k only after every earlier one
                if not mask[b, t + 1 + k]:
                    continue
                counts[k - 1][0] += int(right)
                counts[k - 1][1] += 1
                counts[k - 1][2] += int(all_right)
                if top < 0:
                    continue  # the teacher's choice is outside the draft vocabulary: no CE
                p = torch.softmax(last[b, t + k] @ wd.T, -1)
                ces[k] = -(p * torch.log_softmax(logits[k - 1], -1)).sum()
            weights = {k: math.exp(-(k - 1) / gamma) for k in ces} if dpace_alpha is None \
                else naive_dpace_weights(ces, D, dpace_alpha)
            for k, ce in ces.items():
                total = total + float(scale[b]) * weights[k] * ce
                if weights_out is not None:
                    weights_out[b, n, k] = weights[k]
    return total, counts
