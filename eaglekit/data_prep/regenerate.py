"""Regeneration (self-distillation, as in EAGLE-3 / HASS): the target rewrites every assistant turn.

For each conversation the user (and system) turns are kept and every assistant turn is replaced by what
the target generates given the conversation so far *with its own earlier answers*, so the head later
learns the target's distribution rather than another model's. Conversations are batched with
``generate`` (left padding), turn by turn. Conversations go in windows of ``sort_window`` batches: a
window's conversations are sorted by the length of their first prompt before they are cut into batches,
since a left-padded batch costs its longest prompt in every row (on the demo's 128 ShareGPT first turns,
batches of 32 sorted together prefill 18k positions instead of 47k). A window's finished conversations are
appended to a jsonl file and fsynced, one line per input conversation in input order. A rerun reads that
file, drops a torn last line, checks that the ids it holds are the input's first ids, and continues after
them (from its last whole window). Under a launcher each process takes every N-th window into its own
part file and the parts are merged in window order, so the result is the file one process would write.

On a target split over processes (``target.layout``, eaglekit.target.tensor_parallel) the TP group takes the place
of a process: its processes run every ``generate`` together on the same prompts with the same seeds (the
split model needs all of them for each forward, and they see the same gathered logits, so they pick the
same tokens and stop at the same step), the group's first process alone reads and writes the files, and
the others wait for the finished file. The rank and world of a launch are then the TP groups' (dp_rank,
dp_size).

With ``endpoint`` set the prompts go to an OpenAI-compatible chat-completions server instead (see
``endpoint.py``): ``concurrency`` worker threads each regenerate one conversation at a time, turn by
turn, and the main thread appends the finished ones in input order (a reorder buffer), so the file is
always a prefix of the input and resumes the same way.

A turn whose answer comes back empty, or whose prompt exceeds ``max_prompt_tokens``, ends the
conversation there; a conversation left without any answer is written with ``messages: []`` and a
``regenerate_error`` note, so ``read_conversations`` reports it (file and line) instead of losing it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglekit.config import NonNegFloat, NonNegInt, PosFloat, PosFraction, PosInt
from eaglekit.data_prep.endpoint import ChatEndpoint
from eaglekit.fileio import write_bytes
from eaglekit.target import tensor_parallel as tp

log = logging.getLogger(__name__)


@dataclass
class RegenerateConfig:
    enabled: bool = False
    temperature: NonNegFloat = 0.0  # 0 = greedy
    top_p: PosFraction = 1.0
    max_new_tokens: PosInt = 512
    batch_size: PosInt = 8
    sort_window: PosInt = 8  # batches sorted by prompt length together; also the unit a killed run resumes from
    max_prompt_tokens: PosInt = 2048
    seed: int = 0
    endpoint: str = ""  # http://HOST:PORT/v1 of an OpenAI-compatible server ("" = generate in-process)
    model: str = ""  # the model name sent to the endpoint ("" = the first id of GET /v1/models)
    concurrency: PosInt = 8  # requests in flight at once (endpoint only)
    retries: NonNegInt = 5  # tries after the first for a failed request, with exponential backoff (endpoint only)
    timeout: PosFloat = 600.0  # seconds one request may take (endpoint only)

    def __post_init__(self):
        self.enabled = self.enabled or bool(self.endpoint)  # an endpoint means: regenerate through it

    @property
    def window(self) -> int:
        """Conversations per window: what processes take turns at and a rerun resumes from (a server batches
        its requests itself: no sorting there)."""
        return self.batch_size * (1 if self.endpoint else self.sort_window)


def resume_point(path: Path, ids: list[str], unit: int = 1) -> int:
    """How many conversations ``path`` already holds, cut back to whole units (windows).

    A line without its newline was torn by a kill; a partly written window is cut back too, so a resumed
    run batches (and seeds) exactly like an uninterrupted one.
    """
    if not path.exists():
        return 0
    lines = path.read_bytes().split(b"\n")[:-1]  # the piece after the last newline is torn or empty
    done = [json.loads(line)["id"] for line in lines]
    if done != ids[: len(done)]:
        raise ValueError(
            f"{path} holds other conversations than this input (first ids {done[:3]}); "
            "use another output file or delete it"
        )
    n = len(done) if len(done) == len(ids) else len(done) - len(done) % unit
    with open(path, "r+b") as fh:
        fh.truncate(sum(len(line) + 1 for line in lines[:n]))
    return n


def _generate(target, prompts: list[list[dict]], cfg: RegenerateConfig, seed: int) -> list[str | None]:
    """Answers for chat prompts (None where the prompt is too long)."""
    tok = target.tokenizer
    enc = [_prompt_ids(tok, p) for p in prompts]
    fits = [i for i, e in enumerate(enc) if len(e) <= cfg.max_prompt_tokens]
    answers: list[str | None] = [None] * len(prompts)
    if not fits:
        return answers
    width = max(len(enc[i]) for i in fits)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.full((len(fits), width), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for row, i in enumerate(fits):  # left padding: generation continues every row at the same column
        ids[row, width - len(enc[i]) :] = torch.tensor(enc[i])
        att[row, width - len(enc[i]) :] = 1
    torch.manual_seed(seed)
    sampling = (
        {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
        if cfg.temperature > 0
        else {"do_sample": False}
    )
    if tp.layout_of(target).tp_size > 1:
        # each TP group decodes its own batches: transformers would otherwise step every process of the
        # launch together (synced_gpus, for the FSDP wrapper of a dp x tp layout), and the groups' batch and
        # turn counts differ
        sampling["synced_gpus"] = False
    # a static cache on CPU: the default cache re-concatenates every row's keys and values each step (a third
    # of a batch-16 step here); on GPUs generate would compile the model for it
    cache = {"cache_implementation": "static"} if target.device.type == "cpu" else {}
    out = target.model.generate(
        input_ids=ids.to(target.device),
        attention_mask=att.to(target.device),
        max_new_tokens=cfg.max_new_tokens,
        pad_token_id=pad,
        eos_token_id=_stop_ids(target),
        **cache,
        **sampling,
    )
    for row, i in enumerate(fits):
        answers[i] = tok.decode(out[row, width:], skip_special_tokens=True).strip()
    return answers


def _prompt_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _stop_ids(target) -> list[int]:
    ids = {target.tokenizer.eos_token_id}
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def regenerate_batch(target, convs: list[dict], cfg: RegenerateConfig, seed: int) -> list[dict]:
    """Rewrite every assistant turn of ``convs`` (batched turn by turn across the conversations)."""
    new = [[m for m in c["messages"][:1] if m["role"] == "system"] for c in convs]
    source = [[m for m in c["messages"] if m["role"] != "system"] for c in convs]
    live = list(range(len(convs)))
    errors: dict[int, str] = {}
    for turn in range(0, max(len(s) for s in source), 2):  # user at `turn`, assistant at turn + 1
        live = [b for b in live if turn + 1 < len(source[b])]
        if not live:
            break
        prompts = [new[b] + [source[b][turn]] for b in live]
        answers = _generate(target, prompts, cfg, seed + turn)
        still = []
        for b, prompt, ans in zip(live, prompts, answers):
            if not ans:
                errors[b] = "prompt longer than max_prompt_tokens" if ans is None else "empty answer"
                continue
            new[b] = prompt + [{"role": "assistant", "content": ans}]
            still.append(b)
        live = still
    return [_item(c, new[b], errors.get(b)) for b, c in enumerate(convs)]


def _item(conv: dict, messages: list[dict], error: str | None) -> dict:
    """The output line of one conversation: its regenerated turns, or none and the reason."""
    item = {"id": conv["id"], "messages": messages if any(m["role"] == "assistant" for m in messages) else []}
    if error:
        item["regenerate_error"] = f"stopped at a turn: {error}"
    return item


def regenerate_conversation(
    client: ChatEndpoint, conv: dict, cfg: RegenerateConfig, fits=None, seed: int = 0
):
    """Rewrite every assistant turn of one conversation through ``client``, turn by turn, each prompt
    holding the answers regenerated so far (the same output line as ``regenerate_batch``)."""
    new = [m for m in conv["messages"][:1] if m["role"] == "system"]
    source = [m for m in conv["messages"] if m["role"] != "system"]
    for turn in range(0, len(source) - 1, 2):  # user at `turn`, assistant at turn + 1
        prompt = new + [source[turn]]
        if fits is not None and not fits(prompt):
            return _item(conv, new, "prompt longer than max_prompt_tokens")
        answer = client.chat(prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed + turn,
                             item=f"conversation {conv['id']!r}")
        if not answer:
            return _item(conv, new, "empty answer")
        new = prompt + [{"role": "assistant", "content": answer}]
    return _item(conv, new, None)


def _prompt_check(target, max_prompt_tokens: int):
    """``fits(messages)``: does the chat prompt fit ``max_prompt_tokens``? (None without a target: the
    server then decides.) Serialised: one tokenizer serves every worker thread."""
    if target is None:
        return None
    tok, lock = target.tokenizer, threading.Lock()

    def fits(messages: list[dict]) -> bool:
        with lock:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return len(tok(text, add_special_tokens=False)["input_ids"]) <= max_prompt_tokens

    return fits


def _regenerate_through_endpoint(target, conversations, indices, path: Path, cfg: RegenerateConfig, advance):
    """Regenerate ``conversations[i]`` for ``i`` in ``indices`` on ``cfg.concurrency`` threads; append
    them to ``path`` in ``indices`` order (a finished conversation waits for those before it)."""
    if not indices:
        return
    client = ChatEndpoint(cfg.endpoint, cfg.model, cfg.timeout, cfg.retries)
    # reach the server and name the model before any worker starts
    log.info("regenerating through %s, model %s", cfg.endpoint, client.model)
    fits = _prompt_check(target, cfg.max_prompt_tokens)
    window = 4 * cfg.concurrency  # conversations in flight or waiting to be written: bounds the buffer
    pending, finished, written, error = {}, {}, 0, None
    todo = iter(range(len(indices)))
    pool = ThreadPoolExecutor(max(1, cfg.concurrency), thread_name_prefix="regenerate")
    try:
        with open(path, "a", encoding="utf-8") as fh:
            while error is None:
                while len(pending) + len(finished) < window and (k := next(todo, None)) is not None:
                    i = indices[k]
                    job = pool.submit(
                        regenerate_conversation, client, conversations[i], cfg, fits, cfg.seed + i
                    )
                    pending[job] = k
                if not pending:
                    break
                for job in wait_for(pending, return_when=FIRST_COMPLETED).done:
                    k = pending.pop(job)
                    if job.exception() is not None:
                        error = error or job.exception()
                    else:
                        finished[k] = job.result()
                ready = []
                while written in finished:  # what completed out of order waits for its turn
                    ready.append(finished.pop(written))
                    written += 1
                if ready:
                    _append(fh, ready)
                    advance(len(ready))
    finally:
        client.stop()  # failed or interrupted: the other workers' retries give up
        pool.shutdown(wait=False, cancel_futures=True)
    if error is not None:
        raise error


def regenerate(
    target,
    conversations: list[dict],
    out_path: str | Path,
    cfg: RegenerateConfig | None = None,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    wait: bool = True,
) -> Path:
    """Write ``out_path`` (jsonl) with every assistant turn regenerated by ``target`` (or by the server at
    ``cfg.endpoint``; ``target`` then only checks prompt lengths and may be None); resumes a killed run.

    With ``world_size`` > 1 (one call per process) batch k goes to rank k mod world_size, which appends it
    to its own part file; when every part is complete one process merges them, in batch order, into
    ``out_path`` (the same file one process writes) and removes the parts. ``wait`` polls for the other
    ranks' parts (what a launched process must do before it can go on to the capture). On a split target
    ``rank`` / ``world_size`` are the TP group's (dp_rank, dp_size); see the module doc.
    """
    cfg = cfg or RegenerateConfig(enabled=True)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ids = [str(c["id"]) for c in conversations]
    layout = tp.layout_of(target)
    unit = cfg.window
    if world_size == 1:
        _regenerate_part(target, conversations, out_path, cfg, range(0, len(ids), unit), progress)
    else:
        if tp.same_in_group(layout, _complete(out_path, ids)):  # the group decides as one (its writer's view)
            return out_path
        firsts = range(rank * unit, len(ids), world_size * unit)
        _regenerate_part(target, conversations, part_path(out_path, rank, world_size), cfg, firsts, progress)
    if layout.writes and world_size > 1:
        while not _try_merge(out_path, ids, unit, world_size) and wait:
            time.sleep(2)
    elif not layout.writes:  # a TP group's other processes: the writer's finished file
        while not _complete(out_path, ids) and wait:
            time.sleep(0.5)
    return out_path


def part_path(out_path: Path, rank: int, world_size: int) -> Path:
    return out_path.with_name(f"{out_path.stem}.part{rank}-of-{world_size}.jsonl")


def _regenerate_part(target, conversations, path: Path, cfg: RegenerateConfig, firsts, progress) -> None:
    """Append the windows starting at ``firsts`` to ``path``, after those it already holds. Under TP every
    process of the group generates each batch; only the group's writer reads, cuts back or appends ``path``."""
    from tqdm.auto import tqdm

    unit = cfg.window
    mine = [c for f in firsts for c in conversations[f : f + unit]]
    layout = tp.layout_of(target)
    if cfg.endpoint and not layout.writes:  # the server needs no split forward: the writer asks it alone
        return
    if cfg.endpoint:  # any whole line is kept: a conversation's seed is its index, not its batch's
        indices = [i for f in firsts for i in range(f, min(f + unit, len(conversations)))]
        done = resume_point(path, [str(c["id"]) for c in mine], 1)
        bar = tqdm(total=len(mine), initial=done, desc="regenerate", unit="conv", disable=not progress)
        _regenerate_through_endpoint(target, conversations, indices[done:], path, cfg, bar.update)
        bar.close()
        return
    done = resume_point(path, [str(c["id"]) for c in mine], unit) if layout.writes else None
    done = tp.same_in_group(layout, done)  # the writer's resume point: the group starts at the same window
    bar = tqdm(total=len(mine), initial=done, desc="regenerate", unit="conv", disable=not progress)
    with open(path, "a", encoding="utf-8") if layout.writes else contextlib.nullcontext() as fh:
        for first in list(firsts)[-(-done // unit) :]:  # done: whole windows, or all (a short last one)
            window = conversations[first : first + unit]
            items: list = [None] * len(window)
            for k, rows in enumerate(_length_batches(target, window, cfg)):
                batch = [window[i] for i in rows]
                got = regenerate_batch(target, batch, cfg, seed=cfg.seed + first + k * cfg.batch_size)
                if not tp.agree_in_group(layout, got):  # would write one process's view of a split decoding
                    raise RuntimeError(f"regenerating the batch from conversation {batch[0]['id']!r}: the processes "
                                       "of a TP group generated different answers (their logits differ), so there "
                                       "is no one answer to write")
                for i, item in zip(rows, got):
                    items[i] = item
                bar.update(len(batch))
            if fh is not None:
                _append(fh, items)
    bar.close()


def _length_batches(target, window: list[dict], cfg: RegenerateConfig) -> list[list[int]]:
    """The window's conversations (indices) cut into batches, shortest first prompt first (stable, so the
    same input always gives the same batches); one batch per window is the input order."""
    order = list(range(len(window)))
    if cfg.sort_window > 1:
        def first_prompt(conv: dict) -> list[dict]:
            msgs = [m for m in conv["messages"] if m["role"] != "assistant"]
            return msgs[: 2 if msgs and msgs[0]["role"] == "system" else 1]

        lengths = [len(_prompt_ids(target.tokenizer, first_prompt(c))) for c in window]
        order.sort(key=lengths.__getitem__)
    return [order[k : k + cfg.batch_size] for k in range(0, len(order), cfg.batch_size)]


def _append(fh, items: list[dict]) -> None:
    fh.write("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    fh.flush()
    os.fsync(fh.fileno())


def _complete(path: Path, ids: list[str]) -> bool:
    if not path.exists():
        return False
    lines = path.read_bytes().split(b"\n")[:-1]
    return [json.loads(line)["id"] for line in lines] == ids


def _try_merge(out_path: Path, ids: list[str], unit: int, world_size: int) -> bool:
    """Merge the parts into ``out_path`` once all are complete; True when ``out_path`` is complete."""
    if _complete(out_path, ids):
        return True
    try:
        parts = [part_path(out_path, r, world_size).read_bytes().split(b"\n")[:-1] for r in range(world_size)]
    except FileNotFoundError:  # another process merged and removed them just now, or a rank has not started
        return _complete(out_path, ids)
    if sum(map(len, parts)) < len(ids):
        return False
    batches = [p[k : k + unit] for k in range(0, max(map(len, parts)), unit) for p in parts]
    write_bytes(out_path, b"".join(line + b"\n" for batch in batches for line in batch))
    if not _complete(out_path, ids):
        raise ValueError(
            f"merging the regeneration parts of {out_path} did not give the input's conversations"
        )
    for r in range(world_size):
        part_path(out_path, r, world_size).unlink(missing_ok=True)
    return True
