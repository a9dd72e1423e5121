"""Colocated instances in the simulator: continuous batching with chunked prefill, step by step.

A colocated instance serves both phases in one replica (`Phase.COLOCATED`, vLLM / Sarathi-Serve
style). Each of its lanes steps through the pipeline as a decode lane does; every step carries
the lane's running decodes plus up to `chunk_tokens` prompt tokens, first of the prefills the
lane has begun (oldest first), then of new requests from the instance's queue while the lane has
room for another sequence (`seq_cap`, the decode lanes' memory rule). A step through stage `s`
takes `PerfModel.mixed_node_time_s` on the node that runs it. A request's first token comes when
the step carrying its last chunk ends; it then decodes in that lane, one token a step, with no KV
transfer.
"""
from __future__ import annotations

from typing import cast

from coral.perf.model import Phase, Shape
from coral.sim.cluster import CTX_GRID_TOK, DECODE, PREFILL, Batch, Instance
from coral.sim.core import SimCore


class ColocatedSteps(SimCore):
    """The event handlers of colocated lanes: admitting a request, forming and ending a step."""

    def _enter(self, t: float, lane: Batch, s: int) -> None:
        """Send `lane`'s pass into stage `s` (the request flow's; declared here for the steps below)."""
        raise NotImplementedError

    def _colo_admit(self, t: float, inst: Instance) -> None:
        """A request joined colocated `inst`'s queue: an idle lane starts a step with it at once;
        otherwise the next lane to end a step takes it (FCFS)."""
        if inst.idle_lanes:
            lane = next(x for x in inst.lanes if not x.running)
            self._colo_step(t, lane)

    def _colo_step(self, t: float, lane: Batch) -> None:
        """Start `lane`'s next step, or leave it idle when it has neither decodes nor prompt work.

        The chunk takes up to `chunk_tokens` prompt tokens FCFS: what the lane's begun prefills
        still need, then new requests while the lane holds fewer than `seq_cap` sequences
        (decoding or prefilling). The step is timed at the decodes' mean context and the chunk's
        mean attended context (a piece covering prompt tokens `[a, a + c)` attends `a + c/2` on
        average), each rounded to `CTX_GRID_TOK` as decode steps are.
        """
        inst = lane.inst
        budget = inst.chunk_tokens
        chunk, fresh, partial = lane.chunk, lane.fresh, lane.partial
        chunk.clear()
        fresh.clear()
        prompt, fed = self.r_prompt, self.r_fed
        attended = 0.0  # Σ over the chunk's tokens of the context each attends
        for rid in partial:
            if budget <= 0:
                break
            c = min(prompt[rid] - fed[rid], budget)
            chunk.append((rid, c))
            attended += c * (fed[rid] + c / 2)
            budget -= c
        queue = inst.queue
        while budget > 0 and queue and len(lane.rids) + len(partial) < inst.seq_cap:
            rid = queue.popleft()
            partial.append(rid)
            fresh.append(rid)
            self.r_status[rid] = PREFILL
            c = min(prompt[rid], budget)
            chunk.append((rid, c))
            attended += c * c / 2
            budget -= c
        n = len(lane.rids)
        tokens = inst.chunk_tokens - budget
        if n == 0 and tokens == 0:
            if lane.running:
                lane.running = False
                lane.ctx_sum = 0
                inst.idle_lanes += 1
            return
        if not lane.running:
            lane.running = True
            inst.idle_lanes -= 1
        d_ctx = max(1, round(lane.ctx_sum / n / CTX_GRID_TOK)) * CTX_GRID_TOK if n else 0
        c_ctx = max(1, round(attended / tokens / CTX_GRID_TOK)) * CTX_GRID_TOK if tokens else 0
        key = (Phase.COLOCATED, n, d_ctx, tokens, c_ctx)
        if key != lane.key:
            lane.key = key
            # What travels between stages: the activations of all the step's tokens.
            lane.shape = Shape(phase=Phase.PREFILL, batch=1, prompt_tokens=float(n + tokens), output_tokens=0.0)
        lane.stage = 0
        lane.t0 = t
        self._enter(t, lane, 0)

    def _mixed_time_s(self, cfg: object, inst: Instance, s: int, key: tuple[object, ...]) -> float:
        """One colocated step (`key` as `_colo_step` makes it) through stage `s` on a node of `cfg`."""
        _, n, d_ctx, tokens, c_ctx = cast(tuple[Phase, int, int, int, int], key)
        return float(self.perf.mixed_node_time_s(
            cfg, self.specs[inst.midx], layers=inst.stage_layers[s], decode_batch=n, decode_context=float(d_ctx),
            chunk_tokens=tokens, chunk_context=float(c_ctx), first=s == 0, last=s == len(inst.stages) - 1))

    def _colo_step_done(self, t: float, lane: Batch) -> None:
        """`lane`'s step left the last stage: every decode emitted a token (those at their last
        leave), the chunk's prompt tokens are in (a prefill whose last piece it was emits its
        first token and decodes from the next step on), and the next step starts."""
        inst = lane.inst
        rids = lane.rids
        if self.step_trace is not None:
            self.step_trace((inst.id, "colocated", lane.lane, len(rids) + len(lane.chunk),
                             lane.ctx_sum + sum(c for _, c in lane.chunk), lane.t0, t))
        lane.steps += 1
        emitted = len(rids)
        self._retire_finished(t, lane)
        for rid, c in lane.chunk:
            self.r_fed[rid] += c
            inst.load -= c
            if self.r_fed[rid] == self.r_prompt[rid]:
                lane.partial.remove(rid)
                emitted += 1
                self._colo_first_token(t, lane, rid)
        lane.chunk.clear()
        if self.fe_token:  # off (0) unless Hosts.frontend_work: keeps the hot path free
            self.cpu.frontend_work(t, self.fe_token * emitted)
        self._colo_step(t, lane)

    def _colo_first_token(self, t: float, lane: Batch, rid: int) -> None:
        """`rid`'s prefill ended at `t` with its first token: done if that was its only one, else it
        joins `lane`'s decodes (its KV is already there) for its other `output - 1` tokens."""
        self.r_first[rid] = t
        if self.r_out[rid] <= 1:
            self._complete(t, rid)
            self._release(t, lane.inst, 1)
            return
        self.r_status[rid] = DECODE
        self.r_dstart[rid] = t
        self.r_join[rid] = lane.steps
        lane.rids[rid] = None
        lane.ctx_sum += self.r_prompt[rid] + 1
        lane.finish_at.setdefault(lane.steps + self.r_out[rid] - 1, []).append(rid)

    def _retire_finished(self, t: float, lane: Batch) -> None:
        """A decode step of `lane` is done: every running sequence gained a token of context, and
        those whose last token it made leave the lane (completed, their KV released). Shared by
        decode lanes and colocated lanes."""
        lane.ctx_sum += len(lane.rids)
        done = lane.finish_at.pop(lane.steps, None)
        if done:
            for rid in done:
                del lane.rids[rid]
                lane.ctx_sum -= self.r_prompt[rid] + 1 + lane.steps - self.r_join[rid]
                self._complete(t, rid)
            self._release(t, lane.inst, len(done))
