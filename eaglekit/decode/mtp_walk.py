"""Drafting with an MTP head of several layers walked one per depth (``heads.mtp.MtpHead.walks``): the chain
vLLM's multi-module MTP proposer drafts for a checkpoint shipping several next-n layers (DeepSeek's sequential
MTP modules). A head of one MTP layer drafts through ``drafters.EagleDrafter`` like every autoregressive head."""
from __future__ import annotations

import copy

import torch

from eaglekit.decode.drafters import HeadProposer, Tree, TreeSpec
from eaglekit.heads.layers import HeadCache


class MtpWalkDrafter:
    """A chain from an MTP head of several layers walked one per depth (``MtpHead.walks``), drafted as vLLM's
    multi-module MTP proposer drafts it (DeepSeek's sequential MTP modules).

    Layer k's element t is (layer k-1's output at t, token x_{t+k+1}) at position t (layer 0 reads the target's
    last hidden state), over a cache of layer k's own elements. With x_T the root (the last emitted token), layer
    k's elements t <= T-1-k read accepted tokens only: they are *final*, run once into its cache as they become so
    (``_catch_up``: layer 0 over the newly accepted elements, then each next layer over those its input finished).
    Depth m >= 1 runs layer m over the window t = T-m .. T-1, whose tokens x_{T+1} .. x_{T+m} are this chain's own
    drafts and whose inputs are layer m-1's last final output and its window: run above the layer's final elements
    and cropped away. Each depth's argmax extends the chain, at most one depth per layer. A tree's node would need
    a window per path: chains only (a tree spec's depth is kept, its width ignored)."""

    def __init__(self, target, head, spec: TreeSpec):
        self.features = HeadProposer(target, head)  # the target's last hidden state at verify rows, the device
        self.head, self.layer_ids = head, self.features.layer_ids
        self.depth = min(spec.depth, head.config.num_layers)

    def fork(self) -> MtpWalkDrafter:
        return copy.copy(self)  # prefill() replaces every per-sequence field

    def prefill(self, prompt, out, root):
        n, dev = self.head.config.num_layers, self.features.device
        self.caches = [HeadCache() for _ in range(n)]
        self.outs = [torch.zeros(0, self.head.config.hidden_size, dtype=self.features.dtype, device=dev)] * n
        self.tokens = torch.tensor(prompt[0].tolist() + [root], device=dev)  # x_0 .. x_T, x_T the root
        self.pending = self.features._features(out, torch.arange(prompt.shape[1]))

    def commit(self, tree, path, next_token, out, rows):
        new = torch.tensor(tree.path_tokens(path) + [next_token], device=self.tokens.device)
        self.tokens = torch.cat([self.tokens, new])
        self.pending = self.features._features(out, rows)

    def _catch_up(self) -> torch.Tensor:
        """Run every layer's newly final elements in; → layer 0's logits at element T-1 (for the root's child).
        ``outs[k]``: layer k's outputs at its final elements layer k+1 has not read yet (after a catch-up, its
        last one, element T-1-k)."""
        T, below, root_logits = len(self.tokens) - 1, self.pending, None
        for k, cache in enumerate(self.caches):
            first, last = cache.length, T - 1 - k  # layer k's new final elements
            if last < first:  # a prompt shorter than the layers: the deeper ones wait for more text
                break
            new = last - first + 1
            ids = self.tokens[first + k + 1:last + k + 2]  # element t takes x_{t+k+1}
            pos = torch.arange(first, last + 1, device=ids.device)
            hidden, logits = self.head.step(ids[None], below[:new][None], pos[None], cache=cache, layer=k)
            if k == 0:
                root_logits = logits[0, -1]
            else:
                self.outs[k - 1] = self.outs[k - 1][new:]  # read by layer k
            # the last layer's outputs feed no layer: none kept (its cache grows with the text, they would too)
            self.outs[k] = below = torch.cat([self.outs[k], hidden[0]]) if k + 1 < len(self.caches) else hidden[0, :0]
        self.pending = self.pending[:0]
        return root_logits

    @torch.no_grad()
    def draft(self, max_depth: int) -> Tree:
        logits = self._catch_up()
        T, tokens, qs, window = len(self.tokens) - 1, [], [], None
        for m in range(min(self.depth, max_depth)):
            if m > 0:  # layer m over the window T-m .. T-1: the chain's first m tokens, layer m-1's outputs
                first = T - m
                if first < 0 or self.caches[m].length != first:
                    break
                feed = self.outs[m - 1][-1:] if window is None else torch.cat([self.outs[m - 1][-1:], window])
                pos = torch.arange(first, T, device=feed.device)
                hidden, lg = self.head.step(torch.stack(tokens)[None], feed[None], pos[None], cache=self.caches[m],
                                            layer=m)
                self.caches[m].crop(first)
                window, logits = hidden[0], lg[0, -1]
            q, token = torch.softmax(logits.float(), -1).max(-1)
            tokens.append(token)
            qs.append(q)
        if not tokens:
            return Tree.empty(self.features.device)
        return Tree.chain(self.head.draft_to_target(torch.stack(tokens)), torch.stack(qs))
