"""How stages as processes lie over the ranks: the layout of pipelines and their replicas, the
schedule each pipeline runs, and the device mesh, given or chosen by the planner on the first batch.

Every process holds one device and every rank gets the same batches (replicas split each), but
where a layout is given with replicas, each replica loads only its share (:mod:`.replica_batches`).
"""

from __future__ import annotations

from typing import Any

from ..cpu_allocator import keep_freed_memory
from ..device import shares_host
from ..lightning.runtime import Host, Ranks
from ..planner.layout_search import LayoutSearch, layout_search
from ..plans.layout import Layout
from ..plans.options import AUTO, ProcessOptions
from ..plans.process_schedules import ProcessSchedule, process_schedule
from .replica_batches import replica_loader
from .same_batches import same_order_everywhere


class ProcessRanks(Ranks):
    """The layout, schedule and mesh of stages as processes, for ``strategy`` as ``options`` ask."""

    def __init__(self, strategy: Host, options: ProcessOptions) -> None:
        self.strategy = strategy
        #: what the planner chooses of the layout (``pipeline_parallel_size="auto"`` or
        #: ``schedule="auto"``), or ``None``: both given
        self.search: LayoutSearch | None = layout_search(options.pipeline_ranks, options.schedule,
                                                         options.virtual_stages)
        #: the schedule run (a stand-in until planned, where the planner chooses it)
        self.schedule: ProcessSchedule = self.search.schedules[0] if self.search is not None else process_schedule(
            options.schedule, options.virtual_stages)
        self._pipeline_ranks = None if options.pipeline_ranks == AUTO else options.pipeline_ranks
        self._layout: Layout | None = None
        self._device_mesh: Any = None

    @property
    def layout(self) -> Layout:
        """How the ranks form pipelines and their replicas (where the planner chooses it, once
        planned on the first batch)."""
        if self._layout is None:
            if self.search is not None:
                raise RuntimeError('pipeline_parallel_size="auto" chooses the layout on the first batch')
            self._layout = Layout.of(self.strategy.world_size, self._pipeline_ranks)
        return self._layout

    def use(self, layout: Layout, schedule: ProcessSchedule | None = None, mesh: Any = None) -> None:
        """Run ``layout`` (under ``schedule``, where the planner chose it) on ``mesh``, its mesh
        made before, or else made now (every rank calls it)."""
        self._layout = layout
        if schedule is not None:
            self.schedule = schedule
        self._device_mesh = layout.mesh(self.strategy.root_device.type, self.strategy.timeout) if mesh is None else mesh
        self.strategy.lightning_module._device_mesh = self._device_mesh

    @property
    def device_mesh(self) -> Any:
        return self._device_mesh

    def devices_per_process(self, requested: int | None, node_devices: int) -> int:
        return 1

    @property
    def shards_data(self) -> bool:
        return False  # every rank gets the whole batch; replicas split it

    @property
    def needs_process_group(self) -> bool:
        return True  # stages as processes talk even alone

    def process_dataloader(self, dataloader: object) -> object:
        """The same order in every process (:mod:`.same_batches`), and, where replicas of a
        pipeline train side by side in a layout given (not planned), each replica's share of every
        batch only (:mod:`.replica_batches`)."""
        dataloader = same_order_everywhere(dataloader)
        if self.search is not None or self.layout.dp == 1:
            return dataloader
        return replica_loader(dataloader, self.layout.dp, self.layout.replica(self.strategy.global_rank))

    def check_devices(self, stages: int | None, what: str) -> None:
        if stages is None:
            return
        ranks, schedule = self.layout.pp, self.schedule
        if stages != schedule.num_stages(ranks):
            raise ValueError(
                f"{what} has {stages} stages but {ranks} processes under schedule={schedule.name!r} hold "
                f"{schedule.num_stages(ranks)} ({schedule.virtual_stages} each); start "
                f"{stages / schedule.virtual_stages:g} processes (devices=), or plan for {ranks}")

    def environment_ready(self) -> None:
        if self.strategy.options.share_cpu_allocator and shares_host(self.strategy.root_device):
            keep_freed_memory()  # as stages in one process and planning's profile do
        if self.search is None:
            self.use(self.layout)  # configure_model() may shard or parallelise within a stage
