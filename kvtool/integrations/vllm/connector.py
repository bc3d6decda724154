"""``KvtoolConnector``: vLLM's KV-connector interface over a kvtool store, a thin facade over two halves.

vLLM builds one connector per role, as it does its own ``OffloadingConnector``:
the scheduler's (``KvtoolScheduler``, ``scheduler``) finds stored prefixes
and plans each step; each worker's (``KvtoolWorker``, ``worker``) moves KV
between the store and the paged tensors and reports blocks it could not
restore, so vLLM recomputes them. The plan travels from one to the other in
``KvtoolConnectorMetadata``. The two halves may live in different processes
(vLLM's default on its CPU build and with several workers): they meet in the
store's shared tiers (file, Redis). Both report what they do through vLLM's
KV-connector stats (``stats``, ``metrics``): vLLM's periodic log line and
``/metrics``. It takes part in vLLM's hybrid KV cache allocation (``SupportsHMA``):
a model with several KV cache groups keeps one block table per group, and
sliding-window groups keep only the blocks inside the window (``kv_groups``).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvtool.integrations.vllm import SUPPORTED_VLLM
from kvtool.integrations.vllm.context import ConnectorContext, ConnectorSide
from kvtool.integrations.vllm.metrics import KvtoolConnectorStats, KvtoolPromMetrics
from kvtool.integrations.vllm.plan import StepPlan
from kvtool.integrations.vllm.scheduler import KvtoolScheduler
from kvtool.integrations.vllm.worker import KvtoolWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtool.vllm")


class KvtoolConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, handed to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvtoolConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        _check_vllm_version()
        context = ConnectorContext.from_vllm(vllm_config, self._kv_transfer_config.kv_connector_extra_config,
                                             kv_cache_config)
        self.connector_scheduler: KvtoolScheduler | None = None
        self.connector_worker: KvtoolWorker | None = None
        self._side: ConnectorSide
        if role == KVConnectorRole.SCHEDULER:
            self._side = self.connector_scheduler = KvtoolScheduler(context, vllm_config)
        else:
            self._side = self.connector_worker = KvtoolWorker(context, vllm_config)
        self._log_totals_on_signals()

    @property
    def scheduler(self) -> KvtoolScheduler:
        assert self.connector_scheduler is not None, "a scheduler call on the worker's connector"
        return self.connector_scheduler

    @property
    def worker(self) -> KvtoolWorker:
        assert self.connector_worker is not None, "a worker call on the scheduler's connector"
        return self.connector_worker

    # ==== scheduler side ==================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return KvtoolConnectorMetadata(self.scheduler.build_step_plan(scheduler_output))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Blocks or requests that failed to restore are recomputed by vLLM: save them again afterwards."""
        if connector_output.invalid_block_ids:
            self.scheduler.blocks_failed(connector_output.invalid_block_ids)
        if getattr(connector_output, "failed_recving", None):
            self.scheduler.loads_failed(set(connector_output.failed_recving))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request.request_id)
        return False, None

    # ==== worker side =====================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._plan())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The asynchronous loads this step completed, and those of them that failed."""
        finished, failed = self.worker.take_finished_loads()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvtoolConnectorMetadata) else None

    # ==== both sides ======================================================================

    def get_kv_connector_stats(self) -> KvtoolConnectorStats | None:
        """What this side did since vLLM last asked (both sides are asked after every step)."""
        data = self._side.take_stats()
        return None if data is None else KvtoolConnectorStats(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtoolConnectorStats:
        return KvtoolConnectorStats.from_payload(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtoolPromMetrics:
        return KvtoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._side.shutdown()

    def _log_totals_on_signals(self) -> None:
        """Log the totals when SIGTERM or SIGINT arrives, before vLLM's own handler runs.

        With ``--shutdown-timeout 0`` (vLLM's default) the API server kills the
        engine process right after its SIGTERM, before ``shutdown()`` runs; the
        totals up to the last engine step are logged from the handler instead.
        Only where vLLM installed a handler of its own (the main thread of its
        engine and worker processes).
        """
        if threading.current_thread() is not threading.main_thread():
            return
        side = self._side
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            if callable(previous):
                def handler(sig: int, frame: Any, previous: Any = previous) -> None:
                    side.log_totals()
                    previous(sig, frame)

                signal.signal(signum, handler)


def _log_like_vllm() -> None:
    """Show kvtool's log lines where and as vLLM shows its own, unless the user configured the kvtool logger.

    vLLM configures only its ``vllm`` logger; without this, kvtool's INFO lines
    (startup, shutdown) are hidden unless VLLM_LOGGING_CONFIG_PATH names them.
    """
    kvtool_log = logging.getLogger("kvtool")
    vllm_log = logging.getLogger("vllm")
    if kvtool_log.handlers or not vllm_log.handlers:
        return
    for handler in vllm_log.handlers:
        kvtool_log.addHandler(handler)
    kvtool_log.setLevel(vllm_log.level)
    kvtool_log.propagate = False


def _check_vllm_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        log.warning("kvtool's vLLM connector is tested with vLLM %s, not %s: check docs/VLLM.md",
                    " and ".join(f"{v}.x" for v in SUPPORTED_VLLM), version)
