"""Tiny random models and a tiny tokenizer for fast unit tests (no assets needed)."""
from __future__ import annotations

import weakref
from pathlib import Path

import torch

CHARS = list("abcdefghijklmnopqrstuvwxyz .,!?0123456789")


def tiny_tokenizer(vocab_size: int = 64):
    """A word-level tokenizer with a chat template; ids < vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<bos>", "<user>", "<assistant>", "<system>", "<end>"]
    words = special + CHARS
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    vocab = {w: i for i, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(special)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<end>", bos_token="<bos>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<end>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 64, layers: int = 6, hidden: int = 32, **kw):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    cfg = {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
           "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 6,
           "bos_token_id": 2}
    cfg.update(kw)
    return cls(**cfg)


def tiny_model(arch: str = "llama", seed: int = 0, attn: str = "sdpa", **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **kw)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def tiny_target(arch: str = "llama", seed: int = 0, attn: str = "sdpa", **kw):
    from eaglekit.target import Target

    vocab = kw.get("vocab_size", 64)
    return Target(tiny_model(arch, seed, attn, **kw), tiny_tokenizer(vocab), name=f"tiny-{arch}")


def save_tiny(path: Path, arch: str = "llama", seed: int = 0, **kw) -> Path:
    model = tiny_model(arch, seed, **kw)
    model.save_pretrained(path)
    tiny_tokenizer(kw.get("vocab_size", 64)).save_pretrained(path)
    return Path(path)


def tiny_conversations(path: Path, n: int = 40, seed: int = 0) -> Path:
    """A .jsonl of ``n`` short conversations in the tiny tokenizer's alphabet (answers echo the question)."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            q = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(5, 15)))
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": (q[::-1] + " ") * 3}]
            fh.write(json.dumps({"id": str(i), "messages": msgs}) + "\n")
    return Path(path)


def accelerate_launcher(config: str, processes: int) -> list[str]:
    """``accelerate launch --config_file config --num_processes N`` on a free port: a launch left on
    torch.distributed's default port (29500) fails when anything else holds it (CI saw a ZeRO-3 launch refused
    with EADDRINUSE)."""
    import sys

    from eaglekit.engines.server import free_port

    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
            "--num_processes", str(processes), "--main_process_port", str(free_port())]


def train_command(*overrides: str, processes: int = 1, accelerate_config: str | None = None) -> list[str]:
    """``python train_head.py key=value...`` (1 process) or the same under ``accelerate_launcher``."""
    import sys

    root = Path(__file__).resolve().parents[1]
    if processes == 1:
        return [sys.executable, str(root / "train_head.py"), *overrides]
    return [*accelerate_launcher(accelerate_config, processes), str(root / "train_head.py"), *overrides]


_GREEDY_REFS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {prompt ids: (n, sequence)}


def shared_greedy(model, ids: torch.Tensor, n: int, compute, at_least: int = 0) -> torch.Tensor:
    """``compute(ids, m)`` (a reference greedy decoding of ``m`` new tokens) sliced to its first ``n`` new
    tokens, computed once per model and prompt at ``max(n, at_least)`` and kept for the session. Exact: the
    first n tokens of a greedy decoding do not depend on how many follow (the same forwards, one token at a
    time), so the real-model tests can share their expensive references."""
    memo = _GREEDY_REFS.setdefault(model, {})
    key = tuple(ids[0].tolist())
    if key not in memo or memo[key][0] < n:
        m = max(n, at_least)
        memo[key] = (m, compute(ids, m))
    return memo[key][1][:, :ids.shape[1] + n]


def random_draft_vocab(head, draft_vocab: int) -> None:
    """Give ``head`` a non-trivial draft vocabulary: ``draft_vocab`` target ids drawn at random (sorted), so
    d2t has offsets other than 0 (uses the global torch RNG: seed it first)."""
    vocab = head.config.target_vocab_size
    ids = torch.randperm(vocab)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(draft_vocab), t2d)


def hf_greedy(target, ids: list[int], n: int) -> torch.Tensor:
    """transformers' own greedy decoding of ``n`` new tokens after ``ids`` (no EOS stop): the reference."""
    return target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)


# Threads of a real server process in a test: each pytest-xdist worker has one core of the 2, and a server's
# second thread only spin-waits against the other worker's test (a 40-token llama-server answer took ~15 s so).
SERVER_THREADS = 1


def fit_head(target, conversations: list[dict], out: Path, *overrides: str) -> Path:
    """Train a head on ``conversations`` ([{"id", "messages"}]) against the session's ``target`` (60 optimizer
    steps for 5 conversations, ~20 s on SmolLM2): memorised, so it is accepted deep on those prompts. Every
    conversation is trained on (a copy of the first is the held-out split). Returns the final head folder."""
    import json
    from unittest import mock

    from eaglekit.train import build
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import build_trainer

    out.mkdir(parents=True, exist_ok=True)
    convs = [*conversations, {**conversations[0], "id": "held-out"}]  # the split takes the last one
    data = out / "fitted.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = load_train_config(None, [
        f"target={target.name}", f"data.conversations={data}", "data.eval_samples=1", "data.batch_size=1",
        "data.max_length=256", "head.draft_vocab_size=1024", "loss.ttt_steps=3", "optim.lr=3e-3",
        "optim.warmup_steps=0", "optim.epochs=12", "eval_interval=0", "save_interval=0", "progress=false",
        "trackers=[]", f"output_dir={out / 'run'}", *overrides])
    with mock.patch.object(build, "build_target", lambda cfg, device: target):  # the session's target
        build_trainer(cfg).fit()
    return out / "run" / "final"


def padded_feature_batch(target, lengths=(14, 9), seed=3) -> dict:
    """A training batch of right-padded random rows of ``lengths`` with the target's features, the first 3
    tokens of each row unsupervised (a prompt)."""
    import torch

    torch.manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(0, target.vocab_size, (n,))
        mask[b, 3:n] = 1
    out = target.features(ids, attention_mask=(torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long())
    return {"input_ids": ids, "loss_mask": mask, "last": out.last, "taps": out.taps}


def randomize_norms(head):
    """Norm weights drawn from U(0.5, 1.5) in place (a skipped or swapped norm then changes the output)."""
    import torch

    with torch.no_grad():
        for n, p in head.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return head


def fused_features(target, head, S=12, seed=5):
    """(ids [1, S] drawn at random, the head's fused context feature of the target over them)."""
    import torch

    torch.manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, S))
    return ids, head.fuse_output(target.forward(ids, layer_ids=head.taps))


def scramble_head(head, vocab_size: int, draft_vocab: int):
    """Random norm weights (a skipped or swapped norm then changes the output) and, below the full vocabulary,
    a spread-out draft vocabulary (every (V // Vd)-th id from 1): what export checks run on. Returns the head."""
    import torch

    randomize_norms(head)
    if draft_vocab < vocab_size:
        keep = torch.arange(draft_vocab) * (vocab_size // draft_vocab) + 1
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[keep] = True
        head.set_draft_vocab(keep - torch.arange(draft_vocab), t2d)
    return head


class GreedyChain:
    """A drafter (the loop's protocol) proposing the target's own greedy continuation, ``depth`` tokens deep, with
    the token at index ``wrong`` (None: none) replaced by the next id: every full step then accepts exactly
    ``wrong`` nodes and the rest are rolled back. The greedy tokens are remembered per context (sampling runs
    revisit the same ones)."""

    layer_ids = None

    def __init__(self, target, depth: int = 2, wrong: int | None = None):
        self.t, self.depth, self.wrong = target, depth, wrong

    def prefill(self, prompt, out, root):
        self.ctx = prompt[0].tolist() + [root]

    def commit(self, tree, path, next_token, out, rows):
        self.ctx += tree.path_tokens(path) + [next_token]

    def argmax(self, ctx: tuple) -> int:
        memo = self.t.__dict__.setdefault("_argmax_memo", {})
        if ctx not in memo:
            with torch.no_grad():
                memo[ctx] = int(self.t.model(torch.tensor([ctx])).logits[0, -1].argmax())
        return memo[ctx]

    def draft(self, max_depth: int):
        from eaglekit.decode.drafters import Tree

        ctx, tokens = list(self.ctx), []
        for _ in range(min(self.depth, max_depth)):
            tokens.append(self.argmax(tuple(ctx)))
            ctx.append(tokens[-1])
        if self.wrong is not None and len(tokens) > self.wrong:
            tokens[self.wrong] = (tokens[self.wrong] + 1) % self.t.vocab_size
        return Tree.chain(torch.tensor(tokens, dtype=torch.long), torch.ones(len(tokens)))


class TreeOracle:
    """Drafts a full binary tree ``depth`` deep from the target itself (its own forwards over each path):
    every node's children are the target's second choice, then its first. So every step accepts ``depth``
    nodes, the second child each time, and the output rests on the verify rows of tree nodes, not only the
    root's (an untrained head's nodes are almost never accepted)."""

    layer_ids = None

    def __init__(self, t, depth: int = 3, ranks: tuple = (1, 0)):
        self.t, self.depth, self.ranks, self.memo = t, depth, ranks, {}  # ranks: the children, by target's order

    def top2(self, ctx: tuple) -> list[int]:
        if ctx not in self.memo:
            order = self.t.model(torch.tensor([ctx])).logits[0, -1].argsort(descending=True)
            self.memo[ctx] = [int(order[r]) for r in self.ranks]
        return self.memo[ctx]

    def prefill(self, prompt, out, root):
        self.ctx = tuple(prompt[0].tolist()) + (root,)

    def commit(self, tree, path, next_token, out, rows):
        self.ctx += tuple(tree.tokens[path].tolist()) + (next_token,)

    @torch.no_grad()
    def draft(self, max_depth: int):
        from eaglekit.decode.drafters import Tree

        tokens, parents, depths, frontier = [], [], [], [(-1, ())]
        for d in range(1, min(self.depth, max_depth) + 1):
            nxt = []
            for parent, suffix in frontier:
                for x in self.top2(self.ctx + suffix):
                    tokens.append(x), parents.append(parent), depths.append(d)
                    nxt.append((len(tokens) - 1, suffix + (x,)))
            frontier = nxt
        tokens, parents, depths = (torch.tensor(v, dtype=torch.long) for v in (tokens, parents, depths))
        return Tree(tokens, parents, depths, torch.ones(len(tokens)))


def fit_mtp(head, target, seqs: list[list[int]], steps: int) -> None:
    """A few AdamW steps of the MTP layer on the target's own greedy answers: element t = (h_t, x_{t+1}) learns
    x_{t+2} (the first depth; later depths reuse the layer, as the engines draft)."""
    opt = torch.optim.AdamW(head.layers.parameters(), lr=3e-3)
    data = [(torch.tensor([s]), target.forward(torch.tensor([s]), layer_ids=(), logits=False).last) for s in seqs]
    for _ in range(steps):
        for ids, last in data:
            _, logits = head.step(ids[:, 1:-1], last[:, :-2], torch.arange(ids.shape[1] - 2)[None])
            loss = torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 2:])
            opt.zero_grad()
            loss.backward()
            opt.step()


def nextn_checkpoint(path, cfg, tokenizer, layers: int = 1) -> tuple:
    """A DeepSeek-V3 / GLM-4.5 checkpoint shipping ``layers`` MTP layers as they do, from the config ``cfg`` of its
    class (``cfg.num_hidden_layers`` = L + layers): layers L.. of a random model of that depth (MoE experts one
    tensor each, as save_pretrained writes them), each with enorm / hnorm / eh_proj / shared_head (norm, head) and
    an embed_tokens copy under ``model.layers.{L + k}.``; config num_hidden_layers L, num_nextn_predict_layers
    ``layers``. Returns (the full model, the extra tensors by name)."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    full = getattr(transformers, cfg.architectures[0])(cfg).eval()
    full.save_pretrained(path)
    tokenizer.save_pretrained(path)
    L, H, g = cfg.num_hidden_layers - layers, cfg.hidden_size, torch.Generator().manual_seed(1)
    extras = {}
    for i in range(L, L + layers):
        extras.update({f"model.layers.{i}.{n}.weight": 1 + 0.1 * torch.randn(H, generator=g)
                       for n in ("enorm", "hnorm", "shared_head.norm")})
        extras[f"model.layers.{i}.eh_proj.weight"] = 0.05 * torch.randn(H, 2 * H, generator=g)
        extras[f"model.layers.{i}.shared_head.head.weight"] = full.lm_head.weight.detach().clone()
        extras[f"model.layers.{i}.embed_tokens.weight"] = full.model.embed_tokens.weight.detach().clone()
    save_file({**load_file(path / "model.safetensors"), **extras}, path / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    conf.update(num_hidden_layers=L, num_nextn_predict_layers=layers)
    (path / "config.json").write_text(json.dumps(conf))
    return full, extras
