"""The decode loop: draft → verify in one target forward → accept → keep. One loop for every drafter.

Batch size 1 (the tree differs per sequence; a batch is refused, loop over prompts instead).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from eaglekit.decode import kv
from eaglekit.decode.drafters import EagleDrafter, ModelDrafter, PlainDrafter
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.sampling import Sampling, accept_deterministic, accept_greedy, accept_sampled, sample
from eaglekit.decode.tree import Tree, TreeSpec, verify_mask


@dataclass
class DecodeStats:
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify forward (bonus incl.)
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per forward (root excluded)
    tree_depths: list[int] = field(default_factory=list)
    path_lengths: list[int] = field(default_factory=list)  # root + accepted nodes per forward, before EOS/stop cut
    new_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + acceptance + KV keep
    total_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length per target forward (the prefill forward is not counted)."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def acceptance_per_depth(self) -> list[float]:
        """Rate at depth d: P(node at depth d accepted | depth d-1 accepted and the tree reached d).

        Counted on the accepted paths before an EOS or stop string cut the step short (the cut tokens were
        accepted, not rejected)."""
        rates = []
        for d in range(1, max(self.tree_depths, default=0) + 1):
            tried = sum(1 for a, t in zip(self.path_lengths, self.tree_depths) if a >= d and t >= d)
            ok = sum(1 for a, t in zip(self.path_lengths, self.tree_depths) if a >= d + 1 and t >= d)
            rates.append(ok / tried if tried else float("nan"))
        return rates

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def summary(self) -> dict:
        return dict(tau=self.tau, steps=len(self.accept_lengths), new_tokens=self.new_tokens,
                    tokens_per_s=self.tokens_per_s, acceptance_per_depth=self.acceptance_per_depth,
                    prefill_s=self.prefill_s, draft_s=self.draft_s, verify_s=self.verify_s,
                    total_s=self.total_s)


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [1, prompt + new]
    stats: DecodeStats


def planned_drafter(target, head, plan: dict) -> EagleDrafter:
    """The head's drafter for a ``cost.auto_plan``, carrying the plan's share of a step with a lookup branch
    (``generate(prompt_lookup=...)`` hands it to the ``LookupDrafter``)."""
    dr = EagleDrafter(target, head, TreeSpec(**plan["spec"]))
    dr.nodes_with_lookup = plan.get("nodes_with_lookup")
    return dr


def make_drafter(target, drafter, sampling: Sampling, tree, gamma: int, generator):
    if drafter is None:
        return PlainDrafter()
    if hasattr(drafter, "fingerprint") and hasattr(drafter, "tokenizer"):  # another Target
        return ModelDrafter(target, drafter, gamma, sampling, generator)
    if hasattr(drafter, "step") and hasattr(drafter, "config"):  # an EAGLE head
        if tree == "auto":  # sized from measured costs; plain decoding where no tree is expected to pay
            from eaglekit.decode.cost import auto_plan, drafting_pays

            plan = auto_plan(target, drafter)
            if not drafting_pays(plan):
                warnings.warn(f"tree='auto': this head's best tree is expected at {plan['expected_tokens_per_s']:.1f} "
                              f"tokens/s, plain decoding at {plan['plain_tokens_per_s']:.1f} on this device: "
                              "decoding without drafting (pass an explicit tree to draft anyway)", stacklevel=3)
                return PlainDrafter()
            return planned_drafter(target, drafter, plan)
        return EagleDrafter(target, drafter, tree if isinstance(tree, TreeSpec) else TreeSpec(**(tree or {})))
    if hasattr(drafter, "draft") and hasattr(drafter, "commit"):  # anything following the protocol
        return drafter
    raise TypeError(f"drafter must be None, a Target or an EAGLE head, got {type(drafter).__name__}")


def check_inputs(target, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [1, T], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"decode.generate runs batch size 1 (got {input_ids.shape[0]}): loop over prompts")
    if input_ids.shape[1] == 0:
        raise ValueError("empty prompt: pass at least one token (e.g. the BOS token or a chat template)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ctx = getattr(target.config, "max_position_embeddings", None)
    if ctx and input_ids.shape[1] + max_new_tokens > ctx:
        raise ValueError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the target's context of {ctx} tokens (max_position_embeddings)")


def verify(target, cache, root: int, tree: Tree, drafter):
    """One target forward over the root and every tree node (tree mask, position = past + depth)."""
    past = kv.cache_length(cache)
    dev = target.device
    ids = torch.cat([torch.tensor([root], device=dev), tree.tokens.to(dev)])[None]
    pos = past + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths.cpu()]).to(dev)[None]
    mask = None if tree.is_chain else verify_mask(tree, past, target.dtype, dev)
    out = target.forward(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, kind=drafter.kind,
                         layer_ids=drafter.layer_ids)
    return out, past


def accept(logits: torch.Tensor, tree: Tree, sampling: Sampling, rule, generator) -> tuple[list[int], int]:
    """Walk down from the root: (accepted node indices, next token sampled from what is left)."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    q_full = tree.q_full
    row, path = 0, []
    while True:
        ch = kids[row]
        if sampling.greedy:
            best = int(logits[row].argmax())
            hit = [c for c in ch if tokens[c] == best]
            if not hit:
                return path, best
            node = hit[0]
        else:
            p = sampling.probs(logits[row])
            q = None if q_full is None else q_full[ch]
            i, left = rule(p, [tokens[c] for c in ch], tree.q_token[ch], q, generator) if ch else (None, p)
            if i is None:
                return path, sample(left, generator)
            node = ch[i]
        path.append(node)
        row = node + 1


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_set(target, eos_token_id):
    if eos_token_id is None:
        eos_token_id = getattr(target.model.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = target.tokenizer.eos_token_id
    if eos_token_id is None or eos_token_id is False:
        return set()
    many = isinstance(eos_token_id, (list, tuple, set))
    return {int(e) for e in (eos_token_id if many else [eos_token_id])}


def _finish(new: list[int], max_new: int, eos: set, stop, tokenizer) -> tuple[list[int], bool]:
    """Truncate at the first EOS (kept, as transformers does), a stop string or max_new tokens."""
    done = len(new) >= max_new
    new = new[:max_new]
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1], True
    if stop:
        text = tokenizer.decode(new)
        if any(s in text for s in stop):
            for i in range(1, len(new) + 1):
                if any(s in tokenizer.decode(new[:i]) for s in stop):
                    return new[:i], True
    return new, done


@torch.no_grad()
def generate(target, drafter, input_ids, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_id=None, stop: list[str] | str | None = None,
             seed: int | None = None, generator: torch.Generator | None = None, tree=None, gamma: int = 4,
             streamer=None, acceptance=None, on_step=None, prompt_lookup=0) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` with ``drafter`` (None, a draft Target, or an EAGLE head).

    ``tree``: a ``TreeSpec`` / dict of its fields / ``"auto"`` (sized from measured costs; with
    ``prompt_lookup`` it also keeps fewer head nodes on steps that have a lookup branch) for heads;
    ``gamma``: chain length for a draft model. ``prompt_lookup=N`` adds a branch of up to N tokens copied
    from the context after its last matching n-gram (``lookup.LookupDrafter``; with ``drafter=None`` this
    is prompt lookup decoding); ``prompt_lookup=(2, 5, 10)`` (``lookup.BY_MATCH``, the measured best) sizes
    the branch by the match: 2 tokens after a 1-gram match, 5 after a 2-gram, 10 after a 3-gram.
    ``eos_token_id`` defaults to the model's generation config (``False`` disables it). ``acceptance``
    overrides the acceptance rule (tests only). ``max_new_tokens=0`` returns the prompt unchanged.
    ``on_step(cache, tokens)`` is called after each KV keep with the target cache and the token ids it now
    covers (for tests).
    """
    input_ids = torch.as_tensor(input_ids)
    check_inputs(target, input_ids, max_new_tokens)
    sampling = Sampling(temperature, top_p, top_k)
    if generator is None and seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    stop = [stop] if isinstance(stop, str) else stop
    eos = _eos_set(target, eos_token_id)
    drafter = make_drafter(target, drafter, sampling, tree, gamma, generator)
    if prompt_lookup:
        drafter = LookupDrafter(drafter, prompt_lookup, inner_nodes=getattr(drafter, "nodes_with_lookup", None))
    stats = DecodeStats()
    prompt = input_ids.to(target.device)
    if max_new_tokens == 0:
        return GenerateOutput(prompt.clone(), stats)
    if streamer is not None:
        streamer.put(prompt.cpu())
    _sync(target.device)  # the caller's queued kernels are not this prefill's
    t_start = time.perf_counter()
    cache = kv.new_cache(target.model)
    out = target.forward(prompt, past_key_values=cache, kind=drafter.kind, layer_ids=drafter.layer_ids,
                         logits_to_keep=1)  # only the last row: [S, V] logits of a long prompt cost seconds
    last = out.logits[0, -1]
    root = int(last.argmax()) if sampling.greedy else sample(sampling.probs(last), generator)
    drafter.prefill(prompt, out, root)
    new, done = _finish([root], max_new_tokens, eos, stop, target.tokenizer)
    if streamer is not None:
        streamer.put(torch.tensor(new))
    _sync(target.device)
    stats.prefill_s = time.perf_counter() - t_start
    while not done:
        t0 = time.perf_counter()
        tree = drafter.draft(max_depth=max_new_tokens - len(new) - 1)
        _sync(target.device)
        t1 = time.perf_counter()
        out, past = verify(target, cache, root, tree, drafter)
        rule = acceptance or (accept_greedy if sampling.greedy else
                              accept_sampled if tree.sampled else accept_deterministic)
        path, nxt = accept(out.logits[0], tree, sampling, rule, generator)
        rows = torch.tensor([0] + [n + 1 for n in path])
        kv.keep(cache, past, rows)
        drafter.commit(tree, path, nxt, out, rows)
        emitted = tree.tokens[path].tolist() + [nxt]
        if on_step is not None:
            on_step(cache, torch.cat([prompt[0].cpu(), torch.tensor(new + emitted[:-1])]))
        before = len(new)
        new, done = _finish(new + emitted, max_new_tokens, eos, stop, target.tokenizer)
        stats.accept_lengths.append(len(new) - before)  # what this forward emitted (truncation at the end)
        stats.path_lengths.append(len(path) + 1)
        stats.tree_sizes.append(len(tree))
        stats.tree_depths.append(int(tree.depths.max()) if len(tree) else 0)
        if streamer is not None and len(new) > before:
            streamer.put(torch.tensor(new[before:]))
        root = nxt
        _sync(target.device)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
    stats.total_s = time.perf_counter() - t_start
    stats.new_tokens = len(new)
    if streamer is not None:
        streamer.end()
    return GenerateOutput(torch.cat([prompt, torch.tensor([new], device=prompt.device)], dim=1), stats)
