"""``decode.generate``: lossless speculative decoding of one prompt or a batch with an EAGLE head, a draft
model, any ``Drafter``, or none. It builds the drafter from what the caller passed (``make_drafter``: None,
a draft Target, an EAGLE head or a ready drafter, optionally with a prompt-lookup branch grafted on; one per
row, ``make_row_drafters``: a lone prompt is a batch of one) and runs the loop once (``loop.run``, for one row
or many).
``tree="auto"`` asks ``cost.auto_plan`` for the head's tree."""
from __future__ import annotations

import warnings

import torch

from eaglekit.decode.cost import Plan, auto_plan
from eaglekit.decode.draft_model import ModelDrafter
from eaglekit.decode.drafters import Drafter, EagleDrafter, ParallelDrafter, PlainDrafter, TreeSpec
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.loop import GenerateOutput, Sampling, run
from eaglekit.decode.mtp_walk import MtpWalkDrafter
from eaglekit.decode.stats import BatchStats
from eaglekit.target import CompileError
from eaglekit.target.architectures import UnsupportedArchitecture, check_decodable


@torch.no_grad()
def generate(target, drafter, input_ids, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_id=None, stop: list[str] | str | None = None,
             seed: int | None = None, generator: torch.Generator | None = None, tree=None, gamma: int = 4,
             streamer=None, prompt_lookup=0, attention_mask=None, pad_token_id: int | None = None,
             compile: bool = False) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` after ``input_ids`` [1, T] with ``drafter``: None (plain decoding),
    a draft Target sharing the tokenizer (a chain of ``gamma`` tokens), an EAGLE head, or a ``Drafter``
    (e.g. ``ModelTreeDrafter``, ``LookupDrafter``).

    ``tree`` (heads): a ``TreeSpec``, a dict of its fields, "depth,top_k,total_tokens" (e.g. "5,8,48"), a
    ``cost.Plan``, or ``"auto"`` (sized from measured costs, plain decoding where no tree pays; with
    ``prompt_lookup`` it also keeps fewer head nodes on steps that have a lookup branch). ``prompt_lookup=N``
    adds a branch of up to N tokens copied from the context after its last matching n-gram
    (``lookup.LookupDrafter``; with ``drafter=None`` this is prompt lookup decoding); ``prompt_lookup=(2, 5,
    10)`` (``lookup.BY_MATCH``, the measured best) sizes the branch by the match: 2 tokens after a 1-gram
    match, 5 after a 2-gram, 10 after a 3-gram.
    ``eos_token_id`` defaults to the model's generation config (``False`` disables it); ``stop`` strings
    end the generation too. ``seed`` seeds a generator on the target's device. ``streamer`` (a
    transformers streamer) gets the tokens as they are accepted. ``max_new_tokens=0`` returns the prompt
    unchanged.

    A batch: ``input_ids`` [B, T] left-padded with ``attention_mask`` (0 on the pads), or a list of 1-D
    prompts (left-padded here). Each row decodes as it would alone (``loop.run`` with a drafter per row: one target
    forward per step for all live rows, a drafter per row, rows ending independently). ``sequences`` is
    then [B, T + max_new_tokens]: row b's new tokens at ``sequences[b, T:]``, then ``pad_token_id`` (default
    the tokenizer's pad, else its EOS, else 0); ``stats`` a ``BatchStats`` (``tau`` the mean over rows,
    ``rows[b]`` row b's own). ``drafter`` may then be a list with one per row. No streamer for a batch.

    ``compile=True`` runs the target's verify forward through ``torch.compile`` with static shapes (CUDA graphs
    on a GPU; trees padded to a bucket of 1, 2, 4, ..., 64 nodes): the first steps of each bucket compile, the
    tokens are the same as eager decoding's. A model torch.compile cannot compile raises ``CompileError``.
    """
    batch = _is_batch(input_ids, attention_mask)
    if drafter is not None or prompt_lookup:  # before any token: what the loop cannot verify exactly on it
        tree = check_speculative(target, drafter, tree)
    if compile and getattr(target, "own_cache", False):
        raise CompileError(f"compile=True: {target.name} decodes on its model's own cache ({target.decode_refusal}); "
                           "the compiled verify writes eaglekit's static cache: decode it with compile=False")
    if batch and streamer is not None:
        raise ValueError("a streamer takes one sequence: decode a batch without one (or one prompt at a time)")
    pad_id = _pad_id(target, pad_token_id) if batch else 0  # one sequence has no pads
    ids, starts = pad_prompts(input_ids, attention_mask, pad_id)
    check_context(target, ids.shape[1], max_new_tokens)
    sampling = Sampling(temperature, top_p, top_k)
    if generator is None and seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    drafters = make_row_drafters(target, drafter, ids.shape[0], sampling, generator, tree=tree, gamma=gamma,
                                 prompt_lookup=prompt_lookup)
    stop = [stop] if isinstance(stop, str) else stop
    if batch and ids.shape[0] > 1 and getattr(target, "own_cache", False):
        # the model's own cache (recurrent, indexed or chunked layers) takes no ragged rows: each row alone
        return _rows_alone(target, drafters, ids, starts, max_new_tokens, sampling, generator,
                           eos_ids(target, eos_token_id), stop, pad_id)
    # a list of drafters is run's batch layout (BatchStats, rows padded to T + max_new_tokens), even for one row
    return run(target, drafters if batch else drafters[0], ids, max_new_tokens, sampling, generator,
               eos_ids(target, eos_token_id), stop, streamer, starts=starts, pad_id=pad_id, compile=compile)


def check_speculative(target, drafter, tree):
    """Refuse, before any token, speculative decoding the loop cannot verify exactly on ``target``; returns the
    tree to draft. A target on eaglekit's cache verifies any tree. One on its model's own cache (``own_cache``:
    recurrent, chunked or compressed layers) verifies a chain in one row, its recurrent states recorded and the
    rejected tail cropped, and a tree one row per root-to-leaf path (``loop.verify_paths``); ``Target.chain_refusal``
    says where that is not exact. A head drafts a chain there unless ``tree`` asks for a tree (None: a chain of the
    default depth; "auto": the planner's chain, its costs measured with the state handling)."""
    where = target.name or type(target.model).__name__
    drafters = drafter if isinstance(drafter, (list, tuple)) else [drafter]
    for d in drafters:
        if getattr(d, "decode_refusal", None):  # a draft model's cache is rolled back on eaglekit's cache
            check_decodable(d.config, where=f"draft model {d.name}")
    if not getattr(target, "own_cache", False):
        return tree
    why = target.chain_refusal()
    if why:
        raise UnsupportedArchitecture(f"{where}: speculative decoding refused: {why}. Capture, training and plain "
                                      "decoding (no drafter) work on it.")
    if any(_is_head(d) for d in drafters) and tree is None:
        return TreeSpec(depth=TreeSpec().depth, top_k=1, total_tokens=TreeSpec().depth)
    return tree


def _rows_alone(target, drafters, ids, starts, max_new_tokens, sampling, generator, eos, stop,
                pad_id) -> GenerateOutput:
    """A batch decoded one row at a time (each as it would decode alone), returned in the batch's layout."""
    B, T = ids.shape
    out = torch.full((B, T + max_new_tokens), pad_id, dtype=ids.dtype, device=ids.device)
    out[:, :T] = ids
    total = BatchStats()
    for b in range(B):
        one = run(target, drafters[b], ids[b:b + 1, starts[b]:], max_new_tokens, sampling, generator, eos, stop)
        new = one.sequences[0, T - starts[b]:]
        out[b, T:T + len(new)] = new
        total.rows.append(one.stats)
        total.pool(one.stats)
        total.new_tokens += one.stats.new_tokens
        total.forwards += len(one.stats.accept_lengths)
        for f in ("prefill_s", "draft_s", "verify_s", "total_s"):
            setattr(total, f, getattr(total, f) + getattr(one.stats, f))
    return GenerateOutput(out, total)


def _is_batch(input_ids, attention_mask) -> bool:
    """A list of prompts, a tensor with its attention mask, or several rows: decoded and returned as a batch."""
    if isinstance(input_ids, (list, tuple)) or attention_mask is not None:
        return True
    ids = torch.as_tensor(input_ids)
    return ids.dim() > 0 and ids.shape[0] > 1


def _pad_id(target, pad_token_id) -> int:
    """The id that pads a batch's prompts on the left and its rows after they end."""
    if pad_token_id is not None:
        return int(pad_token_id)
    tok = target.tokenizer
    for candidate in (tok.pad_token_id, tok.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


# ---- which drafter: what the caller passed, as a ``drafters.Drafter`` -----------------------------------

def make_drafter(target, drafter, sampling: Sampling | None = None, generator: torch.Generator | None = None,
                 tree=None, gamma: int = 4, prompt_lookup=0) -> Drafter:
    """The drafter for ``drafter``: None → plain decoding; another Target sharing the tokenizer → a chain of
    ``gamma`` tokens sampled with ``sampling``; an EAGLE head → its EAGLE-2 tree (``tree``: a ``TreeSpec``,
    a dict of its fields, a ``Plan``, or "auto" for ``auto_plan``'s); anything following the ``Drafter``
    protocol → itself. ``prompt_lookup`` (``lookup.LookupDrafter``'s tokens) grafts a prompt-lookup branch
    on top; with a plan, the head keeps the plan's ``nodes_with_lookup`` nodes on steps that have one."""
    inner, plan = _inner(target, drafter, sampling or Sampling(), generator, tree, gamma)
    if not prompt_lookup:
        return inner
    return LookupDrafter(inner, prompt_lookup, inner_nodes=None if plan is None else plan.nodes_with_lookup)


def make_row_drafters(target, drafter, rows: int, sampling: Sampling | None = None,
                      generator: torch.Generator | None = None, tree=None, gamma: int = 4,
                      prompt_lookup=0) -> list[Drafter]:
    """One drafter per row of a batch of ``rows`` prompts: ``make_drafter``'s (a ``Drafter`` given serves
    row 0, its counters count row 0's steps), then ``fork()`` copies of it (one model, a state per row);
    ``drafter`` may also be a list with one drafter (or head, ...) per row. ``tree="auto"`` with a head:
    the plan for this batch size, plain decoding where no tree pays."""
    if isinstance(drafter, (list, tuple)):
        if len(drafter) != rows:
            raise ValueError(f"{len(drafter)} drafters for a batch of {rows} prompts: give one per prompt")
        return [make_drafter(target, d, sampling, generator, tree, gamma, prompt_lookup) for d in drafter]
    # planned for this batch size (a target on its model's own cache decodes a batch row by row: planned for one)
    if tree == "auto" and _is_head(drafter) and rows > 1 and not getattr(target, "own_cache", False):
        tree = auto_plan(target, drafter, batch_size=rows)
        if not tree.drafting_pays:
            warnings.warn(f"tree='auto': for a batch of {rows} this head's best tree is expected at "
                          f"{tree.expected_tokens_per_s:.1f} tokens/s, plain batched decoding at "
                          f"{tree.plain_tokens_per_s:.1f} on this device: decoding without drafting", stacklevel=3)
            drafter = None
    first = make_drafter(target, drafter, sampling, generator, tree, gamma, prompt_lookup)
    if rows > 1 and not hasattr(first, "fork"):
        raise TypeError(f"a batch drafts each row with its own drafter: give {type(first).__name__} a fork() "
                        f"method, or pass a list of {rows} drafters, one per prompt")
    return [first] + [first.fork() for _ in range(rows - 1)]


def _inner(target, drafter, sampling, generator, tree, gamma) -> tuple[Drafter, Plan | None]:
    if drafter is None:
        return PlainDrafter(), None
    if hasattr(drafter, "fingerprint") and hasattr(drafter, "tokenizer"):  # another Target
        return ModelDrafter(target, drafter, gamma, sampling, generator), None
    if _is_head(drafter):
        plan = auto_plan(target, drafter) if tree == "auto" else tree if isinstance(tree, Plan) else None
        if tree == "auto" and not plan.drafting_pays:  # plain decoding where no tree is expected to pay
            warnings.warn(f"tree='auto': this head's best tree is expected at {plan.expected_tokens_per_s:.1f} "
                          f"tokens/s, plain decoding at {plan.plain_tokens_per_s:.1f} on this device: "
                          "decoding without drafting (pass an explicit tree to draft anyway)", stacklevel=4)
            return PlainDrafter(), None
        spec = (plan.spec if plan is not None else tree if isinstance(tree, TreeSpec)
                else TreeSpec.parse(tree) if isinstance(tree, str) else TreeSpec(**(tree or {})))
        if getattr(drafter, "parallel", False):  # a head that samples its block takes the sampling
            return ParallelDrafter(target, drafter, spec, sampling, generator), plan
        if getattr(drafter, "walks", False):  # an MTP head of several layers: one per depth, chains
            return MtpWalkDrafter(target, drafter, spec), plan
        return EagleDrafter(target, drafter, spec), plan
    if hasattr(drafter, "draft") and hasattr(drafter, "commit"):  # anything following the protocol
        return drafter, None
    raise TypeError(f"drafter must be None, a Target or an EAGLE head, got {type(drafter).__name__}")


def _is_head(drafter) -> bool:
    """An EAGLE head (it steps) or a parallel one (it drafts a block: P-EAGLE, DFlash)."""
    return (hasattr(drafter, "step") or getattr(drafter, "parallel", False)) and hasattr(drafter, "config")


# ---- the inputs: prompts as a left-padded batch, their checks, the EOS ids ----------------------------------

def pad_prompts(input_ids, attention_mask, pad_id: int) -> tuple[torch.Tensor, list[int]]:
    """``input_ids`` as a left-padded [B, T] tensor and each row's left padding, checked (no empty prompt).
    Takes a list of 1-D prompts (padded here with ``pad_id``) or a [B, T] tensor (one prompt: [1, T]) with
    ``attention_mask`` (1 on tokens, 0 on the left pads; None = no padding)."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("a list of prompts is padded by generate: pass no attention_mask with it")
        rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in input_ids]
        if not rows:
            raise ValueError("empty list of prompts")
        for b, r in enumerate(rows):
            if r.numel() == 0:
                raise ValueError(f"prompt {b} is empty: pass at least one token (e.g. the BOS token)")
        width = max(len(r) for r in rows)
        ids = torch.stack([torch.cat([r.new_full((width - len(r),), pad_id), r]) for r in rows])
        return ids, [width - len(r) for r in rows]
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [1, T], [B, T] or a list of 1-D prompts, got shape {tuple(ids.shape)}")
    if ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: pass at least one prompt")
    if ids.shape[1] == 0:
        raise ValueError("empty prompt: pass at least one token (e.g. the BOS token or a chat template)")
    if attention_mask is None:
        return ids, [0] * ids.shape[0]
    mask = torch.as_tensor(attention_mask).to(ids.device)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must have input_ids' shape {tuple(ids.shape)}")
    starts = []
    for b, row in enumerate(mask.long().cpu().tolist()):
        n = len(row) - sum(row)
        if any(x not in (0, 1) for x in row) or row != [0] * n + [1] * (len(row) - n):
            hint = ("it is right-padded: tokenize with tokenizer.padding_side = 'left', or pass a list of 1-D "
                    "prompts" if row == [1] * (len(row) - n) + [0] * n else f"got {_short(row)}")
            raise ValueError(f"attention_mask row {b} must be 0 on left pads then 1 on the prompt (left "
                             f"padding): {hint}")
        if n == len(row):
            raise ValueError(f"attention_mask row {b} is all 0: an empty prompt")
        starts.append(n)
    return ids, starts


def _short(row: list, keep: int = 12) -> str:
    """A mask row for an error message: whole if short, else its ends."""
    if len(row) <= 2 * keep:
        return str(row)
    return f"[{', '.join(map(str, row[:keep]))}, ... ({len(row) - 2 * keep} more), {', '.join(map(str, row[-keep:]))}]"


def check_context(target, prompt_len: int, max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ctx = getattr(target.config, "max_position_embeddings", None)
    if ctx and prompt_len + max_new_tokens > ctx:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the target's context of {ctx} tokens (max_position_embeddings)")


def eos_ids(target, eos_token_id) -> set[int]:
    """``eos_token_id`` (an id, a list, None = the model's generation config, False = none) as a set."""
    if eos_token_id is None:
        eos_token_id = getattr(target.model.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = target.tokenizer.eos_token_id
    if eos_token_id is None or eos_token_id is False:
        return set()
    many = isinstance(eos_token_id, (list, tuple, set))
    return {int(e) for e in (eos_token_id if many else [eos_token_id])}
