"""Tensor parallel: a model transformers sharded with `tp_plan="auto"` under torchrun, one engine per rank.

transformers shards the model itself (q/k/v and gate/up column-wise, o/down row-wise with an all-reduce, the
embedding row-wise, the lm_head column-wise with its output gathered), so inside a step each rank's attention sees
its own heads only and every rank ends the forward with the full logits. What the engine adds:

- one attention backend for all ranks (rank 0's choice: "auto" times each rank's GPU separately, and backends
  differ in block size, which the schedule depends on);
- shapes per rank: `num_heads / tp` query and `num_kv_heads / tp` KV heads, so each rank's KV cache holds its own
  KV heads only (a head count that does not divide by the TP size is refused, with the reason);
- one block count for all ranks (the minimum of what each rank's free memory allows), so every rank's block
  manager, and therefore its scheduler, makes the same decisions;
- the same schedule on every rank: each rank runs the user's same script, so the same calls arrive in the same
  order; the engine's decisions are deterministic given the calls, the block count and the prefix-cache state,
  and the one decision that reads local data (has this rank's shard of the weights changed since the last call,
  so the prefix cache must go?) is agreed by an all-reduce: any rank's change clears every rank's cache;
- the same samples on every rank: the logits are identical on all ranks (gathered), the sampler is counter-based,
  and the seed of a sampling call is rank 0's, broadcast at the start of the call (so a script that seeds its
  ranks differently, or not at all, still samples one sequence).

Calls on a tensor-parallel model must come one at a time per rank, in the same order on every rank: the collectives
inside a step pair up by order. A second concurrent call on one rank is refused with an error rather than risk two
ranks pairing different steps. The exception is a model rank 0 leads (engine/tp_driver.py, what `hf-accel serve`
runs): there rank 0 takes any calls at any time and hands its schedule to the other ranks step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    """The TP group of an accelerated model: its size, this process's rank in it and the process group."""

    size: int
    rank: int
    group: Any  # torch.distributed ProcessGroup
    device: torch.device  # where collective tensors live (cuda for NCCL, cpu for gloo)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def min_int(self, value: int) -> int:
        import torch.distributed as dist

        t = self._tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = self._tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def broadcast_str(self, value: str) -> str:
        """Rank 0's `value` on every rank."""
        import torch.distributed as dist

        holder = [value]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(self.group, 0), group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        return str(holder[0])

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank (the group's first rank)."""
        import torch.distributed as dist

        t = self._tensor([value])
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(t.item())


def _tp_mesh(model: torch.nn.Module):
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return mesh["tp"]
    return mesh if mesh.ndim == 1 else None


def tensor_parallel_of(model: torch.nn.Module) -> TensorParallel | None:
    """The model's TP group when transformers sharded it over more than one rank, else None."""
    mesh = _tp_mesh(model)
    if mesh is None or mesh.size() <= 1:
        return None
    import torch.distributed as dist

    group = mesh.get_group()
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return TensorParallel(size=mesh.size(), rank=mesh.get_local_rank(), group=group, device=device)


def local_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel | None) -> tuple[int, int]:
    """Query and KV heads each rank holds; raises when transformers' even split would cut a head."""
    if tp is None:
        return num_heads, num_kv_heads
    if num_heads % tp.size or num_kv_heads % tp.size:
        raise NotImplementedError(
            f"tensor parallel over {tp.size} ranks needs the attention heads ({num_heads}) and key/value heads "
            f"({num_kv_heads}) to divide by {tp.size}: each rank keeps the KV cache of its own heads; use a TP size "
            "that divides both")
    return num_heads // tp.size, num_kv_heads // tp.size


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (what its kernels read); any other tensor as is."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        return to_local()
    return t
