"""Rank 0 drives, the other ranks follow: serving a tensor-parallel model (`hf-accel serve` under torchrun).

A server's calls arrive at rank 0 alone (HTTP), at any time, and end at any time (a client gone, a stop string).
The other ranks cannot run "the same calls in the same order" themselves, so rank 0's engine thread hands them its
schedule instead, one plan per step: every request it added to its engine and every request it aborted since the
last step, in the order it did so, whether the step runs asynchronously, and whether there is a step at all. Each
other rank applies the plan to its own engine and runs the same step. The engine's decisions are deterministic given
those inputs, the agreed block count and the tokens (identical on every rank: the logits are gathered, the sampler is
counter-based and each request's seed travels in its plan), so every rank's step has the same shapes and the
collectives inside it pair up.

What a plan cannot carry is refused on a driven model: requests with host callbacks that decide tokens or stops
(transformers logits processors, stopping criteria, stop strings checked in the engine, `max_time`), whose decisions
exist on rank 0 only. The server applies stop strings itself, by aborting the stream, which a plan does carry.

While nothing runs, rank 0 sends an empty plan every `HEARTBEAT_S` so that the other ranks' waiting collective never
reaches the process group's timeout. A failed step on rank 0 ends the process (torchrun then ends every rank); a
failure on another rank ends that rank, and torchrun the rest.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hf_accel.engine.request import Request, SamplingParams

if TYPE_CHECKING:
    from hf_accel.engine.engine import LLMEngine
    from hf_accel.engine.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # an idle leader's empty plan, well inside the plan group's timeout (gloo: 30 min)


@dataclass(frozen=True)
class RequestSpec:
    """What another rank needs to rebuild a request exactly as rank 0 added it (no callbacks)."""

    request_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    want_scores: bool
    want_logits: bool
    extra_penalty_tokens: tuple[int, ...]

    @classmethod
    def of(cls, req: Request) -> RequestSpec:
        return cls(req.request_id, list(req.prompt_token_ids), req.max_new_tokens, req.sampling, req.eos_token_ids,
                   req.want_scores, req.want_logits, tuple(req.extra_penalty_tokens))

    def build(self) -> Request:
        return Request(self.request_id, list(self.prompt_token_ids), self.max_new_tokens, sampling=self.sampling,
                       eos_token_ids=self.eos_token_ids, want_scores=self.want_scores, want_logits=self.want_logits,
                       extra_penalty_tokens=self.extra_penalty_tokens)


# ("add", the request as rank 0 added it) or ("abort", its request id)
PlanOp = tuple[str, "RequestSpec | int"]


@dataclass
class StepPlan:
    """One step's worth of rank 0's schedule: `ops` in the order rank 0 applied them ("add", RequestSpec) or
    ("abort", request_id); then the step itself when `step`, with `allow_async` as rank 0 set it. `stop`: the
    followers return."""

    ops: list[PlanOp] = field(default_factory=list)
    step: bool = False
    allow_async: bool = False
    stop: bool = False


class PlanChannel:
    """Rank 0's plans to the other ranks over the CPU plan group: one broadcast of a fixed-size buffer per plan (its
    first 8 bytes the pickled plan's length), a second only for a plan that does not fit. `broadcast_object_list`
    takes two broadcasts and more copies every time: measured on this project's 2-core CI machine over gloo
    loopback, about 530 us per empty plan against about 180 us here."""

    BUFFER_BYTES = 8192

    def __init__(self, plans: TensorParallel) -> None:
        self.plans = plans
        self._buf = torch.zeros(self.BUFFER_BYTES, dtype=torch.uint8)
        self._src = None

    @property
    def rank(self) -> int:
        return self.plans.rank

    def _broadcast(self, t) -> None:
        if self._src is None:
            self._src = dist.get_global_rank(self.plans.group, 0)
        dist.broadcast(t, src=self._src, group=self.plans.group)

    def send(self, plan: StepPlan) -> None:
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        base = self._buf.data_ptr()  # a contiguous CPU buffer: written in place (no numpy needed)
        ctypes.memmove(base, n.to_bytes(8, "little"), 8)
        if n <= self.BUFFER_BYTES - 8:
            ctypes.memmove(base + 8, data, n)
            self._broadcast(self._buf)
        else:
            self._broadcast(self._buf)
            self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> StepPlan:
        self._broadcast(self._buf)
        base = self._buf.data_ptr()
        n = int.from_bytes(ctypes.string_at(base, 8), "little")
        if n <= self.BUFFER_BYTES - 8:
            return pickle.loads(ctypes.string_at(base + 8, n))
        big = torch.empty(n, dtype=torch.uint8)
        self._broadcast(big)
        return pickle.loads(ctypes.string_at(big.data_ptr(), n))


def unsupported_reason(req: Request) -> str | None:
    """Why `req` cannot be driven to other ranks, or None."""
    if req.stop_check is not None:
        return ("stopping criteria, stop strings and max_time decide on rank 0's host alone, so they are not "
                "supported when serving a tensor-parallel model (the server applies stop strings itself)")
    if req.logits_hook is not None:
        return ("transformers logits processors run on rank 0's host alone, so they are not supported when serving "
                "a tensor-parallel model")
    return None


class LeaderDriver:
    """Rank 0's side: records the engine changes of its engine thread and hands them out before each step."""

    def __init__(self, plans: TensorParallel) -> None:
        """`plans`: the tensor-parallel ranks over the CPU group the plans travel on (not the model's own group)."""
        if plans.rank != 0:
            raise ValueError(f"only rank 0 drives a tensor-parallel engine (this is rank {plans.rank})")
        self.channel = PlanChannel(plans)
        self.stopping = False  # set by the server's shutdown: the engine thread ends the followers and exits
        self.stopped = False
        self._ops: list[PlanOp] = []

    # called by the engine (LLMEngine.add_request / abort_request) on rank 0's engine thread
    def record_add(self, req: Request) -> None:
        """(EngineLoop.submit refused every request a plan cannot carry: `unsupported_reason`.)"""
        self._ops.append(("add", RequestSpec.of(req)))

    def record_abort(self, req: Request) -> None:
        self._ops.append(("abort", req.request_id))

    def send(self, *, step: bool, allow_async: bool = False) -> None:
        """Hand the recorded changes (and whether a step follows) to every other rank."""
        plan = StepPlan(ops=self._ops, step=step, allow_async=allow_async)
        self._ops = []
        self.channel.send(plan)

    def send_stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.channel.send(StepPlan(ops=self._ops, stop=True))
            self._ops = []

    def fatal(self, exc: BaseException) -> None:
        """A step failed on rank 0: the other ranks' engines can no longer be kept in step with this one, so the
        process ends (torchrun ends the others) rather than serve on out of step or leave them waiting."""
        logger.critical("hf_accel: a step or its plan failed on tensor-parallel rank 0 (%s: %s; if another rank ended "
                        "first, that rank's error is the cause); ending the job: the ranks cannot be kept in step",
                        type(exc).__name__, exc, exc_info=exc)
        logging.shutdown()
        os._exit(1)


def follow(engine: LLMEngine, plans: TensorParallel) -> int:
    """A non-zero rank's side: apply rank 0's plans (received over `plans`, the CPU plan group) to `engine` and run
    its steps until rank 0 stops. Returns the number of forward steps run. Anything that fails here raises (torchrun
    then ends every rank)."""
    if plans.rank == 0:
        raise ValueError("rank 0 drives; the other ranks follow")
    channel = PlanChannel(plans)
    live: dict[int, Request] = {}
    first = engine.stats.steps
    if engine.device.type == "cuda":
        torch.cuda.set_device(engine.device)
    with torch.inference_mode():
        while True:
            plan = channel.receive()
            for kind, arg in plan.ops:
                if kind == "add":
                    req = arg.build()
                    live[req.request_id] = req
                    engine.add_request(req)
                elif kind == "abort":
                    req = live.pop(arg, None)  # None: it finished here too, and was dropped
                    if req is not None:
                        engine.abort_request(req)
                else:
                    raise RuntimeError(f"hf_accel: unknown step-plan operation {kind!r} from rank 0")
            if plan.stop:
                return engine.stats.steps - first
            if plan.step:
                engine.allow_async = plan.allow_async
                engine.step()
                engine.take_hook_errors()  # rank 0 fails the calls; here the requests finished with them already
                for rid in [rid for rid, r in live.items() if r.is_finished]:
                    del live[rid]
