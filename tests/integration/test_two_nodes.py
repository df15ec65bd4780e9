"""Two Ray nodes on this machine, standing in for two hosts (issue 9 item 5): a disaggregated
placement puts training on one node and the rollout pool on the other, and the policy crosses
nodes through trainer/weight_sync.py's broadcast, bit for bit."""

from __future__ import annotations

import json
import shutil
import tempfile
from typing import Any

import pytest
import torch

from tests.e2e import trainer_helpers as helpers
from trainer.config import parse_config

pytestmark = pytest.mark.slow

ray_head = helpers.ray_head
nano_model = helpers.nano_model


@pytest.fixture
def second_node(ray_head):
    """A second raylet joined to the session's head, with two devices of its own; only this
    process is stopped afterwards (never `ray stop`: other clusters run on this machine)."""
    from trainer.placement.local_nodes import start_ray_node, stop_ray_node

    ray = ray_head
    # a short temp dir of its own: Ray's socket paths must fit in 107 bytes
    temp_dir = tempfile.mkdtemp(prefix="yatt-node-b-")
    try:
        proc, node_id = start_ray_node(ray.get_runtime_context().gcs_address, temp_dir=temp_dir,
                                       cpus=2, resources={"yatt_device": 2})
    except RuntimeError as exc:
        shutil.rmtree(temp_dir, ignore_errors=True)
        pytest.fail(str(exc))
    yield node_id
    stop_ray_node(proc)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _worker_class() -> Any:
    """Built in a function so that Ray ships the class itself."""
    from trainer.controller import RolloutWorker

    class InspectableWorker(RolloutWorker):
        def node(self) -> str:
            import ray

            return ray.get_runtime_context().get_node_id()

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.engine.model.state_dict().items()}

    return InspectableWorker


def _source_class() -> Any:
    class Source:
        def __init__(self, cfg_json: str, model_dir: str):
            from trainer.learner import Learner
            from trainer.weight_sync import TrainerWeightSync

            torch.set_num_threads(1)
            self.learner = Learner(parse_config(json.loads(cfg_json)), model_dir, device="cpu")
            with torch.no_grad():  # a policy the workers cannot already hold
                for p in self.learner.policy.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            self.sync = TrainerWeightSync(device=3, bucket_bytes=256 * 1024)

        def node(self) -> str:
            import ray

            return ray.get_runtime_context().get_node_id()

        def address(self) -> tuple[str, int]:
            from trainer import rendezvous

            return rendezvous.host()

        def open_weight_broadcast(self, addr: str, port: int, receivers: list[Any], backend: str) -> None:
            self.sync.open_broadcast(addr, port, receivers, backend=backend)

        def push(self, version: int) -> dict[str, float]:
            return self.sync.push(version, lambda: self.learner.named_weights().items())[0]

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.learner.named_weights().items()}

    return Source


def test_disaggregated_pools_on_two_nodes_and_weights_cross_by_broadcast(ray_head, second_node, nano_model):
    from trainer.placement import build_placement
    from trainer.weight_sync import connect_broadcast

    ray = ray_head
    cfg = parse_config({"model": {"path": nano_model},
                        "algorithm": {"name": "grpo", "kl_coef": 0.0},
                        "rollout": {"engine": "hf", "max_new_tokens": 4},
                        "train": {"batch_size": 4},
                        "placement": {"mode": "disaggregated", "devices": 4, "device_type": "cpu",
                                      "cpus_per_device": 0.5}})
    placement = build_placement(cfg)
    try:
        plan = placement.plan
        assert placement.nodes is not None
        head = ray.get_runtime_context().get_node_id()
        train_nodes = {placement.nodes[d] for d in plan.train_devices}
        rollout_nodes = {placement.nodes[d] for d in plan.rollout_devices}
        assert len(train_nodes) == len(rollout_nodes) == 1 and train_nodes != rollout_nodes
        assert train_nodes | rollout_nodes == {head, second_node}
        assert placement.to_event()["nodes"] == placement.nodes

        env = {"TOKENIZERS_PARALLELISM": "false"}
        cfg_json = cfg.model_dump_json()
        workers = [ray.remote(_worker_class()).options(**placement.actor_options(d, env)).remote(
            cfg_json, d, nano_model, "cpu", 1.0) for d in plan.rollout_devices]
        source = ray.remote(_source_class()).options(
            **placement.actor_options(plan.train_devices[0], env)).remote(cfg_json, nano_model)
        # Ray put each role on its bundle's node
        assert ray.get([w.node.remote() for w in workers]) == [placement.nodes[d] for d in plan.rollout_devices]
        assert ray.get(source.node.remote()) == placement.nodes[plan.train_devices[0]]

        connect_broadcast(source, workers, backend="gloo")
        metrics = ray.get(source.push.remote(1), timeout=300)
        assert metrics["weight_sync/buckets"] >= 2 and metrics["weight_sync/receivers"] == 2
        sent = ray.get(source.weights.remote())
        for got in ray.get([w.weights.remote() for w in workers]):
            assert set(got) == set(sent)
            assert all(torch.equal(got[k], sent[k]) for k in sent)  # bit for bit, across nodes
        assert all(o["version"] == 1 for o in ray.get([w.generate.remote(["1+2="], 1) for w in workers]))
        for actor in [*workers, source]:
            ray.kill(actor)
    finally:
        placement.remove()
