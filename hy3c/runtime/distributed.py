"""Running one rank of a sharded program: the process groups its collectives use.

    bind_process_groups(art.recipe.parallel, rank)   # after torch.distributed.init_process_group

Every rank creates every group of the layout (torch.distributed needs each `new_group` call on all
ranks, in the same order) and binds, under the group's id, the rank set it belongs to
(`hy3c.ops.collectives.bind_groups`); the program's `hy3.all_reduce(x, group, size)` and the others then
run over it. Groups of one rank are left unbound: their collectives do nothing.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from hy3c.ops.collectives import bind_groups
from hy3c.recipe import ParallelSpec

COLLECTIVE_TIMEOUT = timedelta(seconds=300)  # a rank that stops answering fails its peers' steps


def bind_process_groups(
    parallel: ParallelSpec, rank: int, timeout: timedelta = COLLECTIVE_TIMEOUT
) -> dict[int, dist.ProcessGroup]:
    """Create the layout's process groups on this rank (the default group must be initialized, with the
    layout's world size) and bind the ones holding `rank`; returns group id → process group."""
    world = dist.get_world_size()
    if world != parallel.world_size:
        raise RuntimeError(
            f"torch.distributed runs {world} ranks, the artifact's parallel layout needs {parallel.world_size}"
        )
    mine: dict[int, dist.ProcessGroup] = {}
    for group, rank_sets in parallel.groups().items():
        for ranks in rank_sets:
            if len(ranks) == 1:
                continue
            pg = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[group] = pg
    bind_groups(mine)
    return mine
