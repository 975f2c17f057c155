"""Token-budget scheduler: running requests first, then new ones; prefill chunks and decodes in one step.

Each step spends at most `max_num_batched_tokens` tokens. Running requests (decodes, or prefills already under way)
are served first, in arrival order; whatever budget is left admits waiting requests, whose prompts are cut into
chunks when they do not fit. When the KV cache runs out of blocks, the most recently admitted running request is
preempted: its blocks are released and it goes back to the front of the queue, to be recomputed from its prompt and
the tokens it already produced (which the prefix cache often still holds). No request is ever dropped.

Exceptions: a request that may hold blocks is always in `running` or `waiting` (while it moves from one to the other
it is briefly in both), so `live_requests()` is the set whose block lists the block manager must honour, and
`abort_all()` reaches every block holder. Whatever an interruption leaves in between (a block taken and not yet
recorded, a request released halfway) is repaired by `BlockManager.reconcile(scheduler.live_requests())`, which the
engine calls after aborting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hf_accel.engine.block_manager import BlockManager, unique_requests
from hf_accel.engine.request import Request, RequestStatus


@dataclass
class ScheduledStep:
    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens computed for each request this step
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_hit_tokens = 0  # tokens served from the prefix cache at admission, over the engine's life

    def check(self, req: Request) -> None:
        """Refuse a request that could never fit (it would preempt everyone forever). Reads no mutable state."""
        need = self.block_manager.blocks_needed(req.num_prompt_tokens + req.max_new_tokens)
        if need > self.block_manager.num_usable_blocks:
            raise ValueError(
                f"request needs {need} KV blocks (prompt {req.num_prompt_tokens} + {req.max_new_tokens} new tokens) "
                f"but the cache has {self.block_manager.num_usable_blocks}; raise num_kv_blocks or shorten the request"
            )

    def add(self, req: Request) -> None:
        self.check(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_requests(self) -> list[Request]:
        """Every request the scheduler holds (running or waiting), each once: the block holders."""
        return unique_requests((*self.running, *self.waiting))

    def _preempt_last(self, step: ScheduledStep) -> Request:
        """Preempt the most recently admitted running request. It joins the queue before it leaves `running`, so
        it is never in neither (where an abort would not see its blocks)."""
        req = self.running[-1]
        self.waiting.appendleft(req)
        self.running.pop()
        req.status = RequestStatus.WAITING
        self.block_manager.release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        step.preempted.append(req)
        return req

    def _make_room(self, req: Request, num_tokens: int, step: ScheduledStep) -> bool:
        """Blocks for `num_tokens` of the running `req`, preempting the most recently admitted requests until they
        fit. False when `req` itself had to go (it was the last one running)."""
        while not self.block_manager.ensure(req, num_tokens):
            if self._preempt_last(step) is req:
                return False
        return True

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        bs = bm.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            # the Request properties num_generated and num_tokens, inlined: this loop runs over every running request
            generated = len(req.output_token_ids) + req.num_pending_tokens
            if req.num_pending_tokens and generated >= req.max_new_tokens:
                i += 1  # its last token is still on the device: nothing left to compute, it finishes when read
                continue
            n = min(len(req.prompt_token_ids) + generated - req.num_computed_tokens, budget)
            end = req.num_computed_tokens + n
            # most decode steps fit the blocks the request holds: no BlockManager call
            if end > len(req.block_ids) * bs and not self._make_room(req, end, step):
                break  # req itself was preempted: it was the last running one
            step.requests.append(req)
            step.num_tokens.append(n)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not step.preempted:
            req = self.waiting[0]
            if req.block_ids:  # queued requests hold none, unless an exception cut an admission short: start over
                bm.release(req)
            req.num_cached_tokens = bm.admit(req)
            req.num_computed_tokens = req.num_cached_tokens
            self.prefix_hit_tokens += req.num_cached_tokens
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not bm.ensure(req, req.num_computed_tokens + n):
                bm.release(req)
                req.num_computed_tokens = 0
                break
            self.running.append(req)  # in `running` before it leaves the queue: always in one of them
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            step.requests.append(req)
            step.num_tokens.append(n)
            budget -= n
        return step

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request. With asynchronous scheduling it may have been preempted (back in the queue) in the
        step that was planned while its last token was still on the device."""
        queued = req.status == RequestStatus.WAITING
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        (self.waiting if queued else self.running).remove(req)
        self.block_manager.release(req)

    def abort(self, req: Request) -> None:
        """Cancel one request wherever it is (queued, running, or not added at all): out of the queues, its blocks
        given back."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        for queue in (self.waiting, self.running):
            for i, r in enumerate(queue):
                if r is req:
                    del queue[i]
                    break
        self.block_manager.release(req)

    def abort_all(self) -> None:
        """Drop every request, running or waiting, and give back their blocks.

        Waiting requests can hold blocks too: between admit() (its cached prefix blocks) and the end of its
        admission, and after a preemption cut short. Each aborted request is left with no blocks and nothing
        computed. The queues are emptied first, so an interruption here leaves no request behind that
        still counts as live; the blocks of one released only halfway are leaked until the caller runs
        `BlockManager.reconcile()`, which the engine does after every abort."""
        aborted = self.live_requests()
        self.running.clear()
        self.waiting.clear()
        for req in aborted:
            self.block_manager.release(req)
            req.num_computed_tokens = 0
