"""The decode loop: draft → verify in one target forward → accept → keep → commit. One loop for every drafter
and every batch size: a batch is the only shape, one sequence is a batch of one.

``run(target, drafter, ids, ...)`` decodes with a ``drafters.Drafter`` (one sequence) or a list of them, one
per row of a left-padded batch; ``decode.generate`` builds them from a head, a draft model or None
(``api.make_drafter``) and calls it. ``Decoder`` holds the state (the target's cache with each row's slots,
a drafter per row); ``run`` adds what ends a generation (``stops.Ending``), streaming and the stats.

The target's cache (``target.RowsCache``: buffers ``[B, heads, capacity, dim]`` allocated once, sized from the
prompt and ``max_new_tokens``) keeps rows ragged with *masked slots*: row b's text is in slots
``[start_b, length_b)``, where ``start_b`` is its left padding. A verify forward writes 1 + N tokens per row
at slots S.. (S the cache's length: the root and the row's tree, padded with dummy nodes to the largest
tree); its mask lets row b see its own slots and the ancestors of each node, its positions count from
``length_b - start_b``. ``keep_accepted`` then moves each row's root and accepted nodes to slots ``length_b``.. in
place and sets the cache's length to the longest row's. A finished row leaves the batch (``select_cache_rows``).
One sequence has no pad and no ragged slots: a chain is then verified under the model's own causal mask.

``compile=True``: the verify forward runs through ``torch.compile`` (``Target.compiled_forward``; CUDA graphs
on a GPU) with static shapes: the keys are the whole buffer, written at a tensor offset (``static_writes``), the
mask is ``[B, 1, q, capacity]`` with the unused slots blocked, and trees are padded with dummy nodes to a
bucket (``BUCKETS``), so one graph serves every step of a bucket. The prefill and the drafters stay eager.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace

import torch

from eaglekit.decode.drafters import PlainDrafter, Tree, additive, ancestors, catch_up_rows, fetch
from eaglekit.decode.stats import BatchStats, DecodeStats
from eaglekit.decode.stops import Ending
from eaglekit.target import (
    keep_accepted,
    keep_own,
    new_cache,
    record_states,
    row_output,
    select_cache_rows,
    set_cache_length,
    static_writes,
)
from eaglekit.timing import Stopwatch


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [1, prompt + new]; a batch: [B, T + max_new_tokens], padded after each row ends
    stats: DecodeStats


@dataclass
class Step:
    """What one verify forward decided for a row: the tree it verified, the accepted node indices, the next
    token."""

    tree: Tree
    path: list[int]
    next_token: int

    @property
    def emitted(self) -> list[int]:
        """The accepted nodes' tokens, then the next token (the root of the next step)."""
        return self.tree.path_tokens(self.path) + [self.next_token]


class Decoder:
    """The decoding state of one or more rows: the target's cache with each row's slots, a drafter per row.

    ``prefill(ids, starts)`` once, then ``step(roots, max_depths)`` per target forward and ``keep(rows)``
    when rows leave. After a step row b's slots hold its prompt and every emitted token but the last (the
    next root). Decoder row i is whichever prompt the caller maps it to; ``keep`` renumbers them."""

    def __init__(self, target, drafters: list, sampling: Sampling, generator: torch.Generator | None = None,
                 max_new_tokens: int = 0, compile: bool = False):
        self.target, self.drafters, self.sampling, self.generator = target, list(drafters), sampling, generator
        # the target layers every row's drafter reads (one kind per batch); a drafter without taps (None or
        # no layer_ids) reads none: () tells Target.forward to tap nothing, where None means its default taps
        self.layer_ids = tuple(getattr(drafters[0], "layer_ids", None) or ())
        self.max_new_tokens, self.compile = max_new_tokens, compile
        self.cache = self.static = None  # made by prefill, sized from the prompt
        # the model's own cache under drafts (one row: api.generate decodes its batches row by row): its recurrent
        # states are recorded during each verify and the rejected tail cropped (target.keep_own); a tree is verified
        # one batch row per root-to-leaf path (verify_paths), the accepted path's row kept
        self.rollback = getattr(target, "own_cache", False) and not all(isinstance(d, PlainDrafter) for d in drafters)

    def prefill(self, ids: torch.Tensor, starts: list[int]) -> list[int]:
        """Run the left-padded prompts ``ids`` [B, T] into the cache; returns each row's first new token."""
        B, T = ids.shape
        self.starts, self.lengths = list(starts), [T] * B
        dev = self.target.device
        # a target whose layers keep more than keys and values (Target.own_cache) decodes plainly on the cache its
        # model makes in this prefill
        own = getattr(self.target, "own_cache", False)
        self.cache = None if own else new_cache(self.target.model, capacity(T, self.max_new_tokens))
        mask = pos = None  # no pad: the model's own causal mask and positions
        if any(starts):
            s = torch.tensor(starts)[:, None, None]
            i, j = torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
            # a pad row sees itself only (finite, never read); a prompt row its own prompt, causally
            allowed = ((j <= i) & (j >= s)) | ((i < s) & (i == j))
            pos = (torch.arange(T)[None] - torch.tensor(starts)[:, None]).clamp_min(0)
            mask, pos = layer_masks(self.target, allowed, pos, pos), pos.to(dev)
        # logits of the last row only: [S, V] logits of a long prompt cost seconds
        out = self.target.forward(ids.to(dev), attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                                  layer_ids=self.layer_ids, logits_to_keep=1, use_cache=True)
        if own:
            self.cache = out.past_key_values
        last = out.logits[:, -1]
        if self.compile:
            self.static = StaticVerify(self.target, self.cache)
        if self.sampling.greedy:
            roots = last.argmax(-1).tolist()  # one read for every row
        else:
            roots = [sample(self.sampling.probs(last[b]), self.generator) for b in range(B)]
        for b, drafter in enumerate(self.drafters):
            drafter.prefill(ids[b:b + 1, starts[b]:].to(dev), row_output(out, b, slice(starts[b], T)), roots[b])
        return roots

    def step(self, roots: list[int], max_depths: list[int]) -> tuple[list[Step], float, float]:
        """Each row drafts (at most ``max_depths[b]`` deep below ``roots[b]``), one verify forward for all,
        each row accepts, keeps its accepted rows' KV and commits. Returns the rows' ``Step`` and the seconds
        spent drafting and verifying (verify forward, acceptance, keep, commits)."""
        # the previous reading (the prefill's or the last step's) waited for the device already: no third sync
        start = time.perf_counter()
        catch_up_rows(self.drafters)  # heads: every row's accepted tokens in one head forward
        trees = [d.draft(m) for d, m in zip(self.drafters, max_depths)]
        drafted = synced_clock(self.target.device)
        paths = None
        if self.rollback and trees[0].is_chain:
            record_states(self.cache, 1 + len(trees[0]))
        elif self.rollback:
            out, paths = verify_paths(self.target, self.cache, roots[0], trees[0], self.layer_ids)
        if paths is None:
            out, past = verify(self.target, self.cache, roots, trees, self.starts, self.lengths, self.layer_ids,
                               self.static)
        # one read from the device for every row: the trees' nodes and (greedy) the verify rows' argmax
        best = fetch(trees, out.logits.argmax(-1) if self.sampling.greedy else None)
        steps = []
        for b, tree in enumerate(trees):
            path, next_token = accept(out.logits[b, :1 + len(tree)], tree, self.sampling, self.generator,
                                      argmax=None if best is None else best[b])
            steps.append(Step(tree, path, next_token))
        rows = [accepted_rows(s.path) for s in steps]
        if paths is None:
            self.lengths = keep_accepted(self.cache, past, self.lengths, rows, written=out.logits.shape[1])
        else:
            self.lengths = [self.lengths[0] + len(rows[0])]
            keep_path(self.cache, paths, steps[0].path)
        for b, (drafter, s) in enumerate(zip(self.drafters, steps)):
            drafter.commit(s.tree, s.path, s.next_token, row_output(out, b, slice(0, 1 + len(s.tree))), rows[b])
        return steps, drafted - start, synced_clock(self.target.device) - drafted

    def keep(self, rows: list[int]) -> None:
        """Keep decoder rows ``rows`` (in that order) and drop the others; cut the slots no kept row uses."""
        start, end = min(self.starts[b] for b in rows), max(self.lengths[b] for b in rows)
        select_cache_rows(self.cache, rows, start, end)
        if self.static is not None:
            self.static.rebind()  # new buffers: static writes again, at their new addresses
        self.starts = [self.starts[b] - start for b in rows]
        self.lengths = [self.lengths[b] - start for b in rows]
        self.drafters = [self.drafters[b] for b in rows]


# ---- a tree on the model's own cache (recurrent layers): one batch row per root-to-leaf path -------------------
# A recurrent layer reads its input as a sequence (a tree mask means nothing to it), so a node's state must come from
# its parent's: each path is verified as its own row, the cache's one row repeated for them, the state recorded per
# position. A node's verify row is read from the first path through it; after acceptance the rejected tail is
# cropped and the accepted node's path row kept. Shared prefixes are computed once per path through them: a tree
# of n nodes and L leaves verifies L x (1 + depth) positions.

def leaf_paths(tree: Tree) -> list[list[int]]:
    """Each root-to-leaf path of ``tree`` as node indices, in draft order."""
    kids, paths, todo = tree.children(), [], [[]]
    while todo:
        path = todo.pop()
        below = kids[path[-1] + 1 if path else 0]
        if not below:
            paths.append(path)
        todo.extend(path + [c] for c in reversed(below))
    return paths


def verify_paths(target, cache, root: int, tree: Tree, layer_ids=()):
    """One forward over the model's own cache, a row per path of ``tree`` (the root then its nodes, padded with the
    root's token); returns the output gathered into the tree's verify rows ([1, 1 + n, ...]: row 0 the root, row
    i + 1 node i) and the paths."""
    dev, tokens = target.device, tree.host()[0]
    paths = leaf_paths(tree)
    ids = torch.full((len(paths), 1 + max(map(len, paths))), root, dtype=torch.long)
    where = [(0, 0)] + [None] * len(tree)  # verify row -> (path row, column) it is read from
    for r, path in enumerate(paths):
        for col, node in enumerate(path, 1):
            ids[r, col] = tokens[node]
            where[node + 1] = where[node + 1] or (r, col)
    if len(paths) > 1:
        cache.reorder_cache(torch.zeros(len(paths), dtype=torch.long, device=dev))
    record_states(cache, ids.shape[1])
    out = target.forward(ids.to(dev), past_key_values=cache, layer_ids=layer_ids, use_cache=True)
    r, c = (torch.tensor(x, device=dev) for x in zip(*where))
    rows = {f.name: getattr(out, f.name)[r, c][None] for f in fields(out)
            if isinstance(getattr(out, f.name), torch.Tensor)}
    return replace(out, **rows), paths


def keep_path(cache, paths: list[list[int]], accepted: list[int]) -> None:
    """After ``verify_paths``: crop every row to the root and the ``accepted`` nodes (``keep_own``, as a chain's
    step does), then keep the first path row through them."""
    keep_own(cache, True, 1 + len(accepted), written=1 + max(map(len, paths)))
    if len(paths) > 1:
        row = next(r for r, p in enumerate(paths) if p[:len(accepted)] == accepted)
        cache.reorder_cache(torch.tensor([row]))  # each layer moves the index to its device


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has run its queued kernels (CUDA runs them asynchronously; a CPU
    has none to wait for). A step times its two laps with it inline, as ``timing.Stopwatch(synced=True)`` would,
    so that its code stays in the loop's own files."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---- the verify forward and the acceptance walk -------------------------------------------------------------
# Row 0 of a row's verify forward is its root (the last emitted token, not yet in the target's cache), row
# i + 1 its tree node i. The walk starts at the root's row and descends into the first child the acceptance
# rule accepts; where none is, it samples the next token from what the rule left.

def verify(target, cache, roots: list[int], trees: list[Tree], starts: list[int], lengths: list[int],
           layer_ids=(), static: StaticVerify | None = None):
    """One target forward over every row's root and tree, tapping ``layer_ids``; row b's cache slots
    [starts[b], lengths[b]) are its text. Trees are padded to the largest (``static``: to its bucket) with dummy
    nodes (the root's token, seeing the row's text and themselves: finite, never accepted, their KV never kept).
    Row b's verify row i + 1 is its node i, at position (its text length) + depth. Ids, positions and mask are
    built on the target's device from the trees' index tensors. Returns (the ``TargetOutput``, the cache length
    before)."""
    past, dev = max(lengths), target.device  # the cache's length is its longest row's
    n = max(len(t) for t in trees)
    if static is not None:
        n = bucket(n)
    ids = torch.tensor(roots, device=dev)[:, None].repeat(1, 1 + n)
    pos = torch.tensor([m - s for s, m in zip(starts, lengths)], device=dev)[:, None].repeat(1, 1 + n)
    for b, tree in enumerate(trees):
        ids[b, 1:1 + len(tree)] = tree.tokens.to(dev)
        pos[b, 1:1 + len(tree)] += tree.depths.to(dev)
    if static is not None:
        allowed, k_pos = tree_allowed(trees, starts, lengths, past, pos, static.room(past + 1 + n))
        return static.forward(ids, pos, layer_masks(target, allowed, pos, k_pos), past, layer_ids), past
    mask = None
    uniform = not any(starts) and all(m == past for m in lengths)  # one sequence, or rows of one length
    # chains of one length on uniform rows are causal: the model's own mask (its windows included) is the same
    if not (uniform and all(len(t) == n and t.is_chain for t in trees)):
        allowed, k_pos = tree_allowed(trees, starts, lengths, past, pos, past + 1 + n)
        mask = layer_masks(target, allowed, pos, k_pos)
    out = target.forward(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, layer_ids=layer_ids)
    return out, past


def tree_allowed(trees: list[Tree], starts: list[int], lengths: list[int], past: int, pos: torch.Tensor,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed [B, 1 + n, width], the keys' positions [B, width]) of a verify forward writing at slots past..:
    row b's verify rows see its text slots [starts[b], lengths[b]) and their own ancestors; a dummy row sees
    itself; every other slot (stale, or past the forward's end) is blocked. Text slot s is at position
    s - start, a verify slot at its row's position."""
    dev, q = pos.device, pos.shape[1]
    j = torch.arange(width, device=dev)[None]
    s, m = (torch.tensor(x, device=dev)[:, None] for x in (starts, lengths))
    allowed = ((j >= s) & (j < m))[:, None, :].repeat(1, q, 1)
    allowed[:, :, past:past + q] = torch.eye(q, dtype=torch.bool, device=dev)
    for b, tree in enumerate(trees):
        k = len(tree)
        allowed[b, :1 + k, past:past + 1 + k] = ancestors(tree.parents.to(dev))
    k_pos = (j - s).clone()
    k_pos[:, past:past + q] = pos
    return allowed, k_pos


# ---- compile=True: the verify forward with static shapes ----------------------------------------------------

BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)  # tree sizes a compiled verify pads to (past 64: powers of two)


def bucket(n: int) -> int:
    """The smallest bucket holding ``n`` nodes: one compiled graph per bucket, not per tree size."""
    return next((b for b in BUCKETS if b >= n), 1 << (n - 1).bit_length())


def capacity(prompt_len: int, max_new_tokens: int) -> int:
    """Cache entries a generation needs: the prompt, every new token, the largest bucketed verify forward (its
    root and tree) past them; rounded up to 128 so that nearby lengths share one compiled graph. A longer tree
    grows the cache (``target.RowsLayer.reserve``), which a compiled verify pays with a new graph."""
    need = prompt_len + max_new_tokens + 1 + BUCKETS[-1]
    return -(-need // 128) * 128


def compile_mode(device: torch.device) -> str | None:
    """torch.compile's mode: CUDA graphs on a GPU (a small decode step is bound by kernel launches), inductor's
    default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


class StaticVerify:
    """The target's cache written statically (``static_writes``: at the tensor offset ``at``, into buffers of a fixed
    capacity) and its compiled verify forward."""

    def __init__(self, target, cache):
        self.target, self.cache, self.mode = target, cache, compile_mode(target.device)
        self.at = torch.zeros((), dtype=torch.long, device=target.device)
        self.capacity = cache.capacity
        self.rebind()

    def rebind(self) -> None:
        static_writes(self.cache, self.at, self.capacity)

    def room(self, end: int) -> int:
        """The capacity, doubled first if a forward ending at ``end`` would not fit (a new graph: rare)."""
        if end > self.capacity:
            self.capacity = max(end, 2 * self.capacity)
            self.rebind()
        return self.capacity

    def forward(self, ids, pos, mask, past: int, layer_ids):
        self.at.fill_(past)  # in place on the device: the graph reads the offset, it is not baked in
        out = self.target.compiled_forward(ids, attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                                           layer_ids=layer_ids, mode=self.mode)
        set_cache_length(self.cache, past + ids.shape[1])
        return out


def layer_masks(target, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """The additive float masks [B, 1, Q, K] of one forward, from ``allowed`` [B, Q, K] (bool, True = attend)
    and the positions of its queries [B, Q] and keys [B, K]: per layer type, a sliding-window type also hides
    keys ``window`` or more positions behind the query (transformers' rule, by position: a node's slot is
    not its position). One type: one tensor; several: a dict keyed by layer type, which transformers' models
    that mix types take as it is. Floats, since eager attention (Gemma-2, gpt-oss) adds the mask."""
    masks = {}
    for kind, window in getattr(target, "attention_windows", {"full_attention": None}).items():
        seen = allowed if window is None else allowed & (q_pos[:, :, None] - k_pos[:, None, :] < window)
        masks[kind] = additive(seen.to(target.device), target.dtype)[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


def accept(logits: torch.Tensor, tree: Tree, sampling: Sampling, generator=None,
           rule=None, argmax: list[int] | None = None) -> tuple[list[int], int]:
    """Walk down from the root: (accepted node indices, next token sampled from what is left).

    ``logits`` [n + 1, V] are one row's verify rows. Greedy: follow the child equal to the row's argmax
    (every row's argmax read from the device at once; ``argmax`` if the caller read them already, with other
    rows). Else ``rule`` (default ``rule_for(tree)``) decides at each row among its children."""
    kids, tokens = tree.children(), tree.host()[0]
    if sampling.greedy:
        best = logits.argmax(-1).tolist() if argmax is None else argmax
        row, path = 0, []
        while True:
            hit = [c for c in kids[row] if tokens[c] == best[row]]
            if not hit:
                return path, best[row]
            path.append(hit[0])
            row = hit[0] + 1
    rule = rule or rule_for(tree)
    q_full = tree.q_full
    row, path = 0, []
    while True:
        ch = kids[row]
        p = sampling.probs(logits[row])
        q = None if q_full is None else q_full[ch]
        i, left = rule(p, [tokens[c] for c in ch], tree.q_token[ch], q, generator) if ch else (None, p)
        if i is None:
            return path, sample(left, generator)
        node = ch[i]
        path.append(node)
        row = node + 1


def accepted_rows(path: list[int]) -> torch.Tensor:
    """Verify rows of the root and the accepted nodes: what the target's cache keeps."""
    return torch.tensor([0] + [n + 1 for n in path])


# ---- a generation: prefill, steps until every row ended, the output and stats --------------------------------

@torch.no_grad()
def run(target, drafter, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling,
        generator: torch.Generator | None = None, eos: set[int] = frozenset(), stop: list[str] | None = None,
        streamer=None, starts: list[int] | None = None, pad_id: int = 0, compile: bool = False) -> GenerateOutput:
    """Decode up to ``max_new_tokens`` after each row of ``ids`` [B, T] (checked by ``api.pad_prompts``).

    ``drafter`` one drafter: one sequence (``ids`` [1, T]); ``sequences`` is then [1, T + new], ``stats`` a
    ``DecodeStats``, and ``streamer`` (a transformers streamer) gets the prompt, then each step's tokens as
    they are accepted. A list with one drafter per row: a batch, left-padded (row b starts at ``starts[b]``);
    ``sequences`` is [B, T + max_new_tokens], ``pad_id`` after a row ended, ``stats`` a ``BatchStats``. A lone
    row decodes without its left padding, as one sequence does. A row ends after an ``eos`` token (kept), a
    ``stop`` string or ``max_new_tokens``. ``compile``: the verify forward through torch.compile (see the
    module's docstring)."""
    many = isinstance(drafter, (list, tuple))
    drafters = list(drafter) if many else [drafter]
    B, T = ids.shape
    starts = list(starts) if starts is not None else [0] * B
    ids = ids.to(target.device)
    # a lone row without its pads: the model's own causal mask, no ragged slots, the tokens it gets alone
    prompt, starts = (ids[:, starts[0]:], [0]) if B == 1 else (ids, starts)
    rows = [DecodeStats() for _ in range(B)]
    total = BatchStats(rows=rows)
    ends = [Ending(max_new_tokens, eos, stop, target.tokenizer) for _ in range(B)]
    if max_new_tokens > 0:
        _stream(streamer, prompt.cpu())
        clock = Stopwatch(target.device)  # the caller's queued kernels are not this prefill's
        decoder = Decoder(target, drafters, sampling, generator, max_new_tokens, compile)
        roots = decoder.prefill(prompt, starts)
        for b in range(B):
            ends[b].add([roots[b]])
        _stream(streamer, torch.tensor(ends[0].tokens))
        total.prefill_s = clock.lap()
        live = [b for b in range(B) if not ends[b].done]  # the prompt of each decoder row
        if len(live) < B and live:
            decoder.keep(live)
        while live:
            steps, draft_s, verify_s = decoder.step([roots[b] for b in live],
                                                    [max_new_tokens - len(ends[b].tokens) - 1 for b in live])
            kept = []
            for i, (b, step) in enumerate(zip(live, steps)):
                added = ends[b].add(step.emitted)
                rows[b].record(step.tree, step.path, added)
                if added:
                    _stream(streamer, torch.tensor(ends[b].tokens[-added:]))
                roots[b] = step.next_token
                if not ends[b].done:
                    kept.append(i)
            total.draft_s, total.verify_s, total.forwards = (total.draft_s + draft_s, total.verify_s + verify_s,
                                                             total.forwards + 1)
            if len(kept) < len(live):
                live = [live[i] for i in kept]
                if live:
                    decoder.keep(kept)
        total.total_s = clock.elapsed()
        if streamer is not None:
            streamer.end()
    for row, end in zip(rows, ends):
        row.new_tokens = len(end.tokens)
        total.pool(row)
    total.new_tokens = sum(len(end.tokens) for end in ends)
    if B == 1:  # one row: its own stats carry the run's seconds
        one = rows[0]
        one.prefill_s, one.draft_s, one.verify_s, one.total_s = (total.prefill_s, total.draft_s, total.verify_s,
                                                                  total.total_s)
    if not many:  # one sequence: the prompt and its new tokens, the row's own stats
        new = torch.tensor([ends[0].tokens], dtype=ids.dtype, device=ids.device)
        return GenerateOutput(torch.cat([ids, new], dim=1), rows[0])
    out = torch.full((B, T + max_new_tokens), pad_id, dtype=ids.dtype, device=ids.device)
    out[:, :T] = ids
    for b, end in enumerate(ends):
        out[b, T:T + len(end.tokens)] = torch.tensor(end.tokens, dtype=ids.dtype)
    return GenerateOutput(out, total)


def _stream(streamer, tokens: torch.Tensor) -> None:
    if streamer is not None:
        streamer.put(tokens)


# ---- sampling: the distribution we must match and the acceptance rules -----------------------------------
# The distribution we must match (temperature, top-k, top-p → p) and the acceptance rules.
#
# An acceptance rule decides, at one tree node whose target distribution is ``p``, which of the node's
# drafted children (tried in draft order) is accepted, and returns the distribution left to sample from
# when all are rejected. Which rule is lossless depends on how the children were proposed:
#
# * ``accept_deterministic`` — children chosen deterministically (EAGLE top-k): each is a one-hot
#   proposal, so child x is accepted with probability p(x); on rejection p(x) = 0 and p is renormalised,
#   then the next child is tried; if all are rejected, the next token is sampled from what is left.
# * ``accept_sampled`` — children sampled from the drafter's q (a draft model's chain): Leviathan et al.
#   accept with min(1, p(x)/q(x)), else the residual norm(max(p − q, 0)) (SpecInfer's form for several
#   i.i.d. children from the same q).
# * ``accept_minpq_on_topk`` — the classic mistake (min(1, p/q) on deterministically chosen candidates),
#   kept only so tests can show that the sampling check catches a wrong rule.
#
# ``rule_for(tree)`` picks the lossless rule for a tree. At temperature 0 every rule reduces to "accept the
# child equal to argmax p", which ``accept`` does directly.


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy. Order as in transformers: temperature, then top-k, then top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # temperature 0: a field, not a property, so the decode step reads it without a call into this module
    greedy: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "greedy", self.temperature == 0)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Target/draft distribution over the last dim (float32); one-hot argmax when greedy."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_p, order = torch.sort(p, dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
            drop_sorted = before >= self.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            p = p.masked_fill(drop, 0.0)
            p = p / p.sum(-1, keepdim=True)
        return p


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from the (unnormalised, non-negative) distribution ``p`` [V]."""
    if generator is not None and generator.device != p.device:  # e.g. a CPU generator and CUDA p:
        p = p.to(generator.device)  # draw on the generator's device (multinomial refuses a mix)
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(p: torch.Tensor, generator) -> float:
    device = p.device if generator is None else generator.device  # rand refuses a generator elsewhere
    return float(torch.rand((), generator=generator, device=device))


def accept_deterministic(p, tokens, q_token, q_full, generator):
    """One-hot proposals (top-k children): accept x w.p. p(x)/Σp, else zero it and try the next."""
    p = p.clone()
    for i, x in enumerate(tokens):
        if _uniform(p, generator) * float(p.sum()) < float(p[x]):
            return i, p
        p[x] = 0.0
    return None, p


def accept_sampled(p, tokens, q_token, q_full, generator):
    """Leviathan: children x_i ~ q i.i.d.; accept w.p. min(1, p(x)/q(x)), else p ← norm(max(p − q, 0))."""
    p = p / p.sum()
    for i, x in enumerate(tokens):
        q = q_full[i].to(p.device)  # a draft model may sit on another device than the target
        if _uniform(p, generator) * float(q[x]) < float(p[x]):
            return i, p
        rest = (p - q).clamp_min(0.0)
        total = float(rest.sum())
        if total <= 0:  # p == q: a rejection cannot happen; keep p
            continue
        p = rest / total
    return None, p


def rule_for(tree):
    """The lossless rule for how ``tree``'s nodes were proposed: sampled from q (a draft model's chain) or
    chosen (top-k, prompt lookup)."""
    return accept_sampled if tree.sampled else accept_deterministic


def accept_minpq_on_topk(p, tokens, q_token, q_full, generator):
    """WRONG on top-k candidates (biased toward the draft); only for tests that must catch it."""
    p = p.clone()
    for i, x in enumerate(tokens):
        if _uniform(p, generator) * float(q_token[i]) * float(p.sum()) < float(p[x]):
            return i, p
        p[x] = 0.0
    return None, p
