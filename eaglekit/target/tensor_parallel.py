"""Tensor-parallel targets: the target split over a group of processes through transformers' own TP plans.

A launch of ``world`` processes (``torchrun`` / ``accelerate launch``) with ``tp_size = tp`` is laid out as
``dp × tp``: ranks ``[d·tp, (d+1)·tp)`` form TP group ``d``, which holds one copy of the target split ``tp``
ways (DTensor weights, attention heads and MLP columns sharded by the model's ``base_model_tp_plan``). The
processes of a TP group run every target forward together on the *same* input; what differs between TP groups
is the data (``dp_rank`` / ``dp_size``: capture shards, training micro-batches). Only ``tp_rank == 0`` of a
group writes files.

What a hook on the target sees: the plans shard the *inside* of each decoder layer (q/k/v and gate/up
colwise, o_proj and down_proj rowwise with an all-reduce), so every layer's input and output, the final
norm's output and the gathered logits are full tensors, the same on every rank of the group (replicated).
Sharded, and never seen by eaglekit's taps: the per-head attention states, the KV cache (``kv_heads / tp``
heads per rank), the MLP's intermediate activations and the lm_head's own weight. The modules a head borrows
(``embed_tokens``, ``lm_head``) are given to it as plain full copies (``replicate``), so a head never meets a
DTensor.

transformers versions differ in how a ``dp × tp`` layout is asked for (checked on 5.17 and 5.24):
5.24's ``DistributedConfig`` has ``dp_replicate_size`` (the copies of the model; with ``fsdp_size`` 1
nothing is sharded across them); 5.17's has no such field, but takes a 2-D ``device_mesh`` whose ``"tp"``
dimension it splits the model over, with ``tp_size × fsdp_size`` equal to the world (its ``fsdp_size`` is
then only that count: with ``tp_size > 1`` it applies TP alone).
"""
from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict

import torch
from torch import nn

LAUNCH = "torchrun --nproc_per_node {n} -m eaglekit.cli ... (or accelerate launch --num_processes {n})"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process sits in a ``dp × tp`` launch (one process alone: tp_size = world_size = 1)."""
    tp_size: int = 1
    world_size: int = 1
    rank: int = 0

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def writes(self) -> bool:
        """Whether this process writes its TP group's files (one writer per group)."""
        return self.tp_rank == 0

    def group_ranks(self, d: int | None = None) -> list[int]:
        d = self.dp_rank if d is None else d
        return list(range(d * self.tp_size, (d + 1) * self.tp_size))


SINGLE = Layout()


def layout_of(target) -> Layout:
    """How ``target`` is split over processes (no target, as with an endpoint, or a whole one: one process)."""
    return getattr(target, "layout", SINGLE)


def launch_layout(tp_size: int, only_tp: bool = False) -> Layout:
    """This process's layout for ``tp_size`` under the launcher's RANK / WORLD_SIZE, refused when the launch
    cannot hold it (``only_tp``: a job that supports no data parallelism, whose world must equal tp_size)."""
    if tp_size < 1:
        raise ValueError(f"target.tp_size must be >= 1, got {tp_size}")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if tp_size == 1:
        return Layout(1, world, rank)
    if world == 1:
        raise ValueError(f"target.tp_size={tp_size} splits the target over {tp_size} processes, but this is one "
                         f"process: launch it with {LAUNCH.format(n=tp_size)}")
    if only_tp and world != tp_size:
        raise ValueError(f"target.tp_size={tp_size}: this job runs the target alone (no data parallelism), so it "
                         f"needs exactly {tp_size} processes; the launch has {world}")
    if world % tp_size:
        raise ValueError(f"target.tp_size={tp_size} does not divide the launch's {world} processes (world = "
                         f"dp × tp): launch a multiple of {tp_size} processes")
    return Layout(tp_size, world, rank)


def check_model(config, tp_size: int, name: str) -> None:
    """Refuse, before any weight is read, a model that cannot be split ``tp_size`` ways."""
    if tp_size == 1:
        return
    text = getattr(config, "get_text_config", lambda: config)()
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"{name}: {type(text).__name__} has no tensor-parallel plan in transformers "
                         "(base_model_tp_plan), so target.tp_size must be 1 (offline capture with "
                         "target.device_map=auto splits it over devices instead)")
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(text, key, None)
        if n is not None and n % tp_size:
            raise ValueError(f"{name}: target.tp_size={tp_size} does not divide its {key}={n} (each process holds "
                             f"whole heads): use a tp_size that divides {n}")


def init_distributed() -> None:
    """The default process group (gloo on CPU, nccl on CUDA), unless a launcher's library already made it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def from_pretrained_kwargs(layout: Layout) -> dict:
    """What ``from_pretrained`` needs to split the model over this process's TP group (see the module doc)."""
    if layout.tp_size == 1:
        return {}
    from transformers.distributed import DistributedConfig

    init_distributed()
    fields = DistributedConfig.__dataclass_fields__
    if layout.dp_size == 1:
        return {"distributed_config": DistributedConfig(tp_size=layout.tp_size)}
    if "dp_replicate_size" in fields:  # 5.24 has it, 5.17 does not
        return {"distributed_config": DistributedConfig(tp_size=layout.tp_size, dp_replicate_size=layout.dp_size)}
    from torch.distributed import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (layout.dp_size, layout.tp_size), mesh_dim_names=("fsdp", "tp"))
    return {"distributed_config": DistributedConfig(tp_size=layout.tp_size, fsdp_size=layout.dp_size),
            "device_mesh": mesh}


@torch.no_grad()
def settle(model: nn.Module) -> None:
    """Run one token through a model that transformers wrapped in FSDP2 (its ``dp_replicate`` layout): FSDP
    takes the first module called as its root, and a first call of the decoder alone (a capture's forward,
    which skips the lm_head) would leave it with several. Every process of a TP group calls it together."""
    if any(type(m).__name__.startswith("FSDP") for m in model.modules()):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device))


def group(layout: Layout):
    """This process's TP group as a torch process group (made once per layout; every rank must call it)."""
    import torch.distributed as dist

    if layout.tp_size == 1:
        return None
    groups = _GROUPS.get(layout.world_size)
    if groups is None:  # every rank creates every group, in the same order, as new_group requires
        groups = [dist.new_group(Layout(layout.tp_size, layout.world_size, d * layout.tp_size).group_ranks())
                  for d in range(layout.dp_size)]
        _GROUPS[layout.world_size] = groups
    return groups[layout.dp_rank]


_GROUPS: dict[int, list] = {}


def same_in_group(layout: Layout, value):
    """``value`` as this TP group's first rank has it (a picklable object), so the group decides as one."""
    if layout.tp_size == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=layout.group_ranks()[0], group=group(layout))
    return box[0]


def agree_in_group(layout: Layout, value) -> bool:
    """Whether every process of this TP group holds an equal ``value`` (a picklable object); every process
    gets the same answer, so all of them can stop together when it is False. Only a digest of the pickled
    value travels (a batch of regenerated conversations is tens of KB per process)."""
    if layout.tp_size == 1:
        return True
    import hashlib
    import pickle

    import torch.distributed as dist

    seen = [None] * layout.tp_size
    dist.all_gather_object(seen, hashlib.sha256(pickle.dumps(value)).hexdigest(), group=group(layout))
    return all(v == seen[0] for v in seen)


def data_parallel(acc, target) -> tuple[int, int]:
    """(world, rank) over which a training run splits its batches: the processes (``acc``, an Accelerator),
    or their TP groups when ``target`` is split (world = dp × tp; each group's processes share one batch)."""
    size = layout_of(target).tp_size
    return acc.num_processes // size, acc.process_index // size


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value as a plain tensor on this process (a plain tensor as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def replicate(module: nn.Module) -> nn.Module:
    """A twin of ``module`` (an embedding, an lm_head) with full plain-tensor weights and none of the TP
    hooks or forward replacements that redistribute its inputs and outputs: what a draft head borrows from a
    split target."""
    # a shallow copy with its own dicts below: the class (and e.g. an embedding scale) kept, less the wrapper
    # class FSDP2 puts around a module (transformers' dp_replicate layout)
    cls = next(c for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))
    twin = cls.__new__(cls)
    twin.__dict__.update(module.__dict__)
    twin.__dict__.pop("forward", None)  # transformers' TP may replace a module's forward on the instance
    twin._parameters = OrderedDict((k, None if p is None else nn.Parameter(full(p.detach()).clone(), requires_grad=False))
                                   for k, p in module._parameters.items())
    twin._buffers = OrderedDict((k, None if b is None else full(b)) for k, b in module._buffers.items())
    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                  "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(twin, hooks, OrderedDict())
    return twin
