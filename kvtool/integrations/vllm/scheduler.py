"""The connector's scheduler half: which stored prefix a request restores, and what each step saves.

vLLM calls it in its engine process (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished``). It finds the longest
stored prefix past vLLM's own prefix-cache hit and plans, per step, which
entries to restore into which blocks and which finished prompt blocks to save
(``plan``); the ``StepPlan`` goes to the workers inside the connector's
metadata. Loads are synchronous from vLLM's point of view: they complete within
the step that needs them. Reads only attributes of vLLM's request and
scheduler-output objects, so it runs without vLLM in tests.

For a model whose KV cache kvtool cannot restore exactly (``context.refusal``)
it says why once, at start-up, and then claims and saves nothing. Where vLLM
can recompute a failed load only per request (several KV cache groups, or
sliding windows: ``ModelKV.per_request_failures``) loads are asynchronous from
vLLM's point of view: the worker completes them in the step they are planned
for and reports each request loaded or failed; a failed request is not
restored again, vLLM computes it from the start.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtool.integrations.vllm.context import ConnectorContext, ConnectorSide
from kvtool.integrations.vllm.kv_groups import SKIPPED
from kvtool.integrations.vllm.plan import (
    LoadJob, RequestState, SaveJob, StepPlan, block_table, entries_to_save, kept, load_jobs,
)
from kvtool.entries.names import find_stored_prefix, tokens_in

log = logging.getLogger("kvtool.vllm")


class KvtoolScheduler(ConnectorSide):
    """The scheduler's state: what each request found in the store, loads waiting for their step, the API."""

    side = "scheduler"

    def __init__(self, context: ConnectorContext, vllm_config: Any) -> None:
        super().__init__(context)
        self._requests: dict[str, RequestState] = {}
        self._pending_loads: dict[str, list[LoadJob]] = {}
        self._failed_loads: set[str] = set()  # requests whose restore failed: vLLM computes them instead
        self._api = None
        if context.refusal is not None:
            log.warning("kvtool restores nothing for this model: %s; vLLM computes every prompt", context.refusal)
        if context.settings.api is not None:
            from kvtool.integrations.vllm.embedded import start_in_vllm

            self._api = start_in_vllm(self.store, context.settings.api, context.settings, context.namer, vllm_config)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past vLLM's own hit the store holds, and whether they load asynchronously."""
        bs = self.context.block_size
        hashes = request.block_hashes
        state = RequestState(hashes, request.num_prompt_tokens)
        self._requests[request.request_id] = state
        if self.context.refusal is not None or request.request_id in self._failed_loads:
            return 0, False
        if len(hashes) != request.num_tokens // bs:
            log.debug("request %s: block hashes do not match block size %d; not using kvtool", request.request_id, bs)
            return 0, False
        try:
            state.stored = find_stored_prefix(
                hashes, (request.num_tokens - 1) // bs, self.context.blocks_per_entry, self.context.namer,
                self.store.contains_many, tokens_in(self.store),
            )
        except Exception:
            log.exception("request %s: kvtool store lookup failed; computing the prompt", request.request_id)
            state.stored = []
        state.local_tokens = num_computed_tokens
        restored = state.restored_blocks()
        state.saved_blocks = restored - restored % self.context.blocks_per_entry
        new_tokens = max(0, restored * bs - num_computed_tokens)
        self.stats.count("lookups")
        self.stats.count("lookup_hits", 1 if new_tokens else 0)
        self.stats.count("tokens_found", new_tokens)
        log.debug("request %s: %d tokens found in the kvtool store (vLLM had %d)",
                  request.request_id, new_tokens, num_computed_tokens)
        return new_tokens, new_tokens > 0 and self.context.kv.per_request_failures

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return
        bs = self.context.block_size
        local = state.local_tokens // bs
        limit = local + num_external_tokens // bs
        jobs = load_jobs(state.stored, local, tuple(kept(ids) for ids in blocks.get_block_ids()), limit)
        if jobs:
            self._pending_loads[request.request_id] = jobs

    def build_step_plan(self, scheduler_output: Any) -> StepPlan:
        """The loads allocated since the last step, and the entries this step completes."""
        plan = StepPlan(loads=self._pending_loads)
        self._pending_loads = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = tuple(kept(ids) for ids in block_table(new.block_ids))
                self._plan_saves(new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0), plan)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = tuple(kept(ids) for ids in block_table(cached.new_block_ids[i] or ()))
            if req_id in cached.resumed_req_ids:
                state.block_ids = new_ids
            elif new_ids:
                state.block_ids = tuple(ids + more for ids, more in zip(state.block_ids, new_ids)) or new_ids
            self._plan_saves(req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan)
        return plan

    def _plan_saves(self, req_id: str, state: RequestState, computed_tokens: int, plan: StepPlan) -> None:
        """Entries this step completes; one with a block vLLM did not keep (it came from vLLM's own cache,
        past a sliding window) is not saved: its bytes there are not the prompt's."""
        bs = self.context.block_size
        if self.context.refusal is not None or not state.block_ids:
            return
        spans = entries_to_save(
            state.block_hashes, state.prompt_tokens // bs, computed_tokens // bs,
            state.saved_blocks, self.context.blocks_per_entry, self.context.namer,
        )
        for span in spans:
            if span.end > min(len(ids) for ids in state.block_ids):
                break
            blocks = tuple(ids[span.start:span.end] for ids in state.block_ids)
            if not any(SKIPPED in ids for ids in blocks):
                plan.saves.setdefault(req_id, []).append(SaveJob(span.entry_id, blocks, span.start * bs))
            state.saved_blocks = span.end

    def blocks_failed(self, invalid_block_ids: set[int]) -> None:
        """Blocks that failed to restore are recomputed by vLLM: save them again afterwards."""
        per_entry = self.context.blocks_per_entry
        for state in self._requests.values():
            bad = [i for ids in state.block_ids for i, block in enumerate(ids) if block in invalid_block_ids]
            if bad:
                first = min(bad)
                state.saved_blocks = min(state.saved_blocks, first - first % per_entry)

    def loads_failed(self, request_ids: set[str]) -> None:
        """Requests whose asynchronous restore failed: vLLM computes them from the start; never claim them again."""
        self._failed_loads |= request_ids
        for request_id in request_ids:
            self._pending_loads.pop(request_id, None)

    def request_finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._failed_loads.discard(request_id)

    def shutdown(self) -> None:
        if self._api is not None:
            self._api.stop()
            self._api = None
        super().shutdown()

    def _log_summary(self, done: dict[str, Any]) -> None:
        log.info("kvtool at shutdown (scheduler): %d lookups, %d hits (%d tokens found), %d misses",
                 done["lookups"], done["lookup_hits"], done["tokens_found"], done["lookups"] - done["lookup_hits"])
