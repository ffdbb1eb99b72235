"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` as pure data-parallel FSDP2, under the name ``fsdp2``.

The learner shards only over data-parallel ranks, so every process is one data-parallel rank (Lightning's default
is tensor parallelism within a node). By default it writes one full checkpoint file, atomically, rather than a
folder of shards that a crash mid-save would leave half-written; ``save_distributed_checkpoint: true`` gives the
folder, for models whose full state does not fit in rank 0's CPU memory.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from typing_extensions import override


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (``data_parallel_size`` = world size, no tensor parallelism).

    Args:
        save_distributed_checkpoint: Write a folder of per-rank shards instead of one full file.
        **kwargs: ``ModelParallelStrategy``'s other arguments (``process_group_backend``, ``timeout``).
    """

    def __init__(self, save_distributed_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint, **kwargs,
        )  # fmt: skip

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # resolved here, once devices are known
        super().setup_environment()


if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 over every process (lit_gmc)")
