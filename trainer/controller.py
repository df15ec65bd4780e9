"""A controller: the whole RL loop for one data-parallel rank (the YATT programming model).

Read its shard of prompts → ask the sampler for `n` responses each → score them → dynamic
sampling → advantages and policy update, gradients all-reduced with the other controllers →
push the new weights to its sampler → report scalars (and phase spans) to the driver. Samples
and tensors never leave the controller except to its own sampler.

The sampler is in-process when colocated (it sleeps while the policy trains) and/or a set of
rollout-worker actors on other devices (disaggregated, or the single-controller baseline). In
disaggregated mode the rollout of the next step is dispatched before this step trains
(`placement.staleness` steps ahead at most), so generation and training overlap. New weights
go out through trainer/weight_sync.py: in place into the colocated sampler; from controller 0,
one bucketed broadcast to every rollout worker of the run.
In partial_colocate mode the controller does not score: it streams chunks of finished samples
to the reward scorers on the scoring devices while its sampler still decodes the rest.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint as ckpt
from trainer import rendezvous
from trainer.config import TrainerConfig, parse_config
from trainer.host_memory import steady_heap
from trainer.learner import DataParallelGroup, Learner, RLBatch
from trainer.placement.cost_model import evening_share
from trainer.rollout.decode_delay import apply_decode_delay
from trainer.sampling import DynamicSampler, Group
from trainer.telemetry import DeviceMonitor, PhaseRecorder
from trainer.weight_sync import (
    TrainerWeightSync,
    WeightReceiver,
    WeightSyncGroup,
    drain_weights,
    sampler_wire_dtype,
)

__all__ = ["PromptStream", "PromptShards", "ControllerLoop", "RolloutWorker"]

# partial_colocate: a rollout's samples go to the scorers in about this many chunks, so scoring
# starts after the first eighth of the samples finish and little is left when the last one does.
STREAM_CHUNKS = 8
# samples per step (per rank) kept with the step's spans, so a reader can check the rewards
SCORED_SAMPLES_KEPT = 8


class PromptStream:
    """This rank's shard of the training prompts, reshuffled each epoch; its position is the
    whole state needed to continue exactly where it stopped."""

    def __init__(self, examples: list[Any], *, rank: int, world: int, seed: int, salt: str = ""):
        self.shard = examples[rank::world] or examples
        self.rank, self.seed, self.salt = rank, seed, salt
        self.position = 0
        self._epoch = -1
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.shard)))
            random.Random(f"{self.salt}:{self.seed}:{self.rank}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order

    def take(self, k: int) -> list[Any]:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.position, len(self.shard))
            out.append(self.shard[self._order_for(epoch)[i]])
            self.position += 1
        return out


class PromptShards:
    """The training prompts cut into `shards` fixed streams (one per device); rank r of `world`
    reads shards r, r + world, … and takes from its least-advanced one first.

    A shard's position does not depend on which rank reads it, so a gang of another world size
    (placement.mode=auto moving roles) continues every shard exactly where the last gang stopped:
    no prompt is skipped or trained twice. With `shards == world` it is PromptStream.
    """

    def __init__(self, examples: list[Any], *, rank: int, world: int, shards: int, seed: int,
                 salt: str = ""):
        if shards < world:
            raise ValueError(f"{shards} prompt shards cannot feed {world} ranks")
        self.parts = {v: PromptStream(examples, rank=v, world=shards, seed=seed, salt=salt)
                      for v in range(rank, shards, world)}

    def take(self, k: int) -> list[Any]:
        out = []
        for _ in range(k):
            v = min(self.parts, key=lambda v: (self.parts[v].position, v))
            out += self.parts[v].take(1)
        return out

    @property
    def position(self) -> int:
        return sum(p.position for p in self.parts.values())

    def positions(self) -> dict[int, int]:
        return {v: p.position for v, p in self.parts.items()}

    def load_positions(self, positions: dict[int, int]) -> None:
        for v, part in self.parts.items():
            part.position = int(positions.get(v, part.position))


def _sample_dict(s: Any) -> Any:
    return s  # Sample is a plain dataclass: it travels through Ray as it is


class RolloutWorker:
    """A sampler on its own device (disaggregated pool, or a single controller's helpers)."""

    def __init__(self, cfg_json: str, device: int, model_dir: str, device_type: str, cores: float):
        from trainer.rollout import make_engine

        steady_heap()
        self.cfg = parse_config(__import__("json").loads(cfg_json))
        self.device = device
        threads = max(1, int(cores))
        torch.set_num_threads(threads)
        self.monitor = DeviceMonitor(device, device_type=device_type, cores=cores)
        self.engine = make_engine(self.cfg, model_dir, threads=threads, seed=self.cfg.seed + 101 * device)
        self.version = -1
        self.model_dir = model_dir
        self.torch_device = "cuda" if device_type == "gpu" else "cpu"
        self.reference: Any = None  # a FrozenReference, once the learner has sent its weights

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[str], n: int, reference_rows: int = 0) -> dict[str, Any]:
        """``n`` samples per prompt; the first ``reference_rows`` of them also carry the frozen
        reference's log-probs (`placement.reference_on_rollout`), computed here after generating."""
        start = time.time()
        samples = self.engine.generate(prompts, n)
        apply_decode_delay(self.version + 1, samples)  # YATT_SLOW_DECODE; a no-op unless set
        end = time.time()
        spans = [{"device": self.device, "phase": "rollout", "start": start, "end": end}]
        if reference_rows > 0:
            if self.reference is None:
                raise RuntimeError("reference log-probs asked for before the reference weights came")
            scored = samples[:reference_rows]
            refs = self.reference.logprobs([s.prompt_ids for s in scored], [s.response_ids for s in scored])
            for s, lps in zip(scored, refs, strict=True):
                s.ref_logprobs = lps
            spans.append({"device": self.device, "phase": "reference", "start": end, "end": time.time()})
        return {"samples": samples, "version": self.version, "device_metrics": self.monitor.sample(),
                "spans": spans}

    def open_weight_sync(self, master_addr: str, master_port: int, rank: int, world: int,
                         backend: str) -> None:
        """Join the weight broadcast group as receiver `rank` (trainer.weight_sync)."""
        self.weights_in = WeightReceiver(WeightSyncGroup(master_addr, master_port, rank, world,
                                                         backend=backend))

    def receive_weights(self) -> dict[str, Any]:
        """Take the next broadcast of the policy into the engine, bucket by bucket as it arrives;
        afterwards this worker samples with that policy version. Returns its span."""
        stats = self.weights_in.receive(self.engine.update_weights)
        self.version = stats.version
        return {"device": self.device, "phase": "weight_sync", "start": stats.start, "end": stats.end}

    def receive_reference(self) -> dict[str, Any]:
        """Take the learner's frozen reference (one broadcast, at the run's start) into this
        worker's own copy, for `generate(..., reference_rows=...)`. Returns its span."""
        from trainer.learner import FrozenReference

        if self.reference is None:
            self.reference = FrozenReference(self.cfg, self.model_dir, device=self.torch_device)
        stats = self.weights_in.receive(self.reference.load)
        return {"device": self.device, "phase": "weight_sync", "start": stats.start, "end": stats.end}

    def close(self) -> None:
        self.engine.close()


@dataclass
class _Pending:
    prompts: list[Any]
    local: list[Any]
    refs: list[Any]
    shares: list[list[Any]]
    version: int
    stream_before: Any = None  # the prompt stream's state before these prompts were taken
    reference_share: float = 0.0  # of each worker's samples, scored by its reference copy


class ReferenceSplit:
    """How much of the reference pass the rollout workers take (`placement.reference_on_rollout`).

    Disaggregated, a step lasts as long as the busier side: a worker's generation (R) plus its
    reference log-probs for a share ``f`` of its samples, or the training rank's work (W) plus the
    reference pass over the rest. With ``a`` and ``b`` the seconds per sample of a reference pass
    on a worker and on the training rank, ``m`` workers of ``N`` samples each feeding this rank,
    each worker serving ``k`` ranks in turn (a rollout pool smaller than the training pool):
    ``k (R + a f N) = W + b m N (1 - f)``, so ``f = (W + b m N - k R) / (N (k a + b m))``, within
    [0, 1].
    The inputs are the last steps' measured phase times (halfway averages); `auto` starts at 0
    and skips the first ``warmup`` steps (first engine calls, an empty prefetch queue).
    """

    def __init__(self, setting: float | str, *, trainer_cores: float, worker_cores: float,
                 warmup: int = 1, ranks_per_worker: int = 1):
        self.auto = setting == "auto"
        self.k = max(1, ranks_per_worker)
        self.share = 0.0 if self.auto else float(setting)
        self.core_ratio = trainer_cores / max(worker_cores, 1e-9)
        self.est: dict[str, float] = {}
        self.warmup = warmup

    def _blend(self, key: str, value: float) -> None:
        old = self.est.get(key)
        self.est[key] = value if old is None else 0.5 * (old + value)

    def observe(self, *, worker_rollout_s: float, worker_reference_s: float, worker_rows: int,
                worker_reference_rows: int, workers: int, trainer_busy_s: float,
                trainer_reference_s: float, trainer_reference_rows: int) -> float:
        """One step's measurements (a worker's, the busiest; this rank's own); returns the share
        for the next rollouts submitted."""
        if not self.auto or worker_rows <= 0 or workers <= 0:
            return self.share
        if self.warmup > 0:
            self.warmup -= 1
            return self.share
        self._blend("R", worker_rollout_s)
        self._blend("W", max(0.0, trainer_busy_s - trainer_reference_s))
        if trainer_reference_rows > 0:
            self._blend("b", trainer_reference_s / trainer_reference_rows)
        if worker_reference_rows > 0:
            self._blend("a", worker_reference_s / worker_reference_rows)
        b = self.est.get("b")
        a = self.est.get("a", b * self.core_ratio if b is not None else None)
        if a is None or b is None:
            return self.share
        n, m, k = float(worker_rows), float(workers), float(self.k)
        self.share = evening_share(k * self.est["R"], self.est["W"] + b * m * n,
                                   moved_to_rollout=k * a * n, moved_from_train=b * m * n)
        return self.share

    def rows(self, samples: int) -> int:
        """Of a worker's ``samples``, how many it scores with its reference copy."""
        return min(samples, round(self.share * samples))


class ControllerLoop:
    """The loop of one controller. Lives inside a Ray actor (see trainer.driver); `drain()` is
    called from another thread of that actor and hands the driver what happened since."""

    def __init__(self, cfg_json: str, *, rank: int, world: int, device: int, device_type: str,
                 cores: float, run_dir: str, rollout_workers: list[tuple[int, Any]],
                 local_sampler: bool, model_dir: str,
                 reward_scorers: list[tuple[int, Any]] | None = None, stoppable: bool = False,
                 prompt_shards: int = 0):
        steady_heap()  # before the engine and the learner allocate
        self.cfg: TrainerConfig = parse_config(__import__("json").loads(cfg_json))
        self.rank, self.world, self.device = rank, world, device
        self.device_type, self.cores = device_type, cores
        self.run_dir = Path(run_dir)
        self.rollout_workers = rollout_workers
        self.local_sampler = local_sampler
        self.model_dir = model_dir
        self.reward_scorers = reward_scorers or []  # (device, RewardScorer actor): partial_colocate
        self._chunks_sent = 0
        self._stream_stats = {"scoring": 0.0, "overlapped": 0.0, "rollout_scored": 0.0}
        self._records: list[dict[str, Any]] = []
        self._drained_step = 0  # the newest step whose metrics the driver has drained
        self._lock = threading.Lock()
        self.recorder = PhaseRecorder(device)
        self.monitor = DeviceMonitor(device, device_type=device_type, cores=cores)
        self._device_metrics: dict[str, float] = {}
        self._remote_spans: list[dict[str, Any]] = []
        self.weight_sync = TrainerWeightSync(
            device=device, bucket_bytes=int(self.cfg.rollout.weight_sync_bucket_mb * 2**20),
            wire_dtype=sampler_wire_dtype(self.cfg, device_type))
        # placement.mode=auto: the driver may ask the gang to stop at a step boundary and re-plan
        self.stoppable = stoppable
        self.prompt_shards = prompt_shards  # > 0: PromptShards, whose positions survive a new world size
        self._stop_requested = threading.Event()
        # colocated on a GPU, the trainer's state makes room for the local sampler's generation
        self._swaps_device = device_type == "gpu"
        self._trainer_away = False  # the trainer's state is in host memory while the sampler runs

    # ------------------------------------------------------------------ the driver's view
    def _emit(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._records.append({"rank": self.rank, **record})

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self._records = self._records, []
            steps = [r["step"] for r in out if r.get("type") == "metrics"]
            if steps:  # the driver holds this rank's reports through here (checkpoint.prune)
                self._drained_step = max(self._drained_step, max(steps))
        return out

    def open_weight_broadcast(self, master_addr: str, master_port: int, receivers: list[Any],
                              backend: str) -> None:
        """Make this controller the source of the weight broadcast to `receivers` (every rollout
        worker of the run, whichever controller they sample for): one copy per step for all."""
        self.weight_sync.open_broadcast(master_addr, master_port, receivers, backend=backend)

    def request_stop(self) -> None:
        """Stop after a checkpoint at the next step boundary all ranks agree on (see `_agree_to_stop`)."""
        self._stop_requested.set()

    def _agree_to_stop(self) -> bool:
        # the request reaches ranks at different moments: every rank shares its flag each step so
        # that all of them stop after the same step
        flag = 1.0 if self._stop_requested.is_set() else 0.0
        return self.learner.all_reduce_sum([flag])[0] > 0

    def _event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self._emit({"type": "event", "kind": kind, "message": message, "data": data or {}})

    # ------------------------------------------------------------------ set-up
    def _setup(self, master_addr: str, master_port: int) -> None:
        cfg = self.cfg
        threads = max(1, int(self.cores))
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed + self.rank)
        random.seed(cfg.seed + self.rank)
        self.group: DataParallelGroup | None = None
        if self.world > 1:
            self.group = DataParallelGroup(master_addr, master_port, self.rank, self.world,
                                           backend="nccl" if self.device_type == "gpu" else "gloo")
        from trainer.data import load_task
        from trainer.rewards import build_reward

        self.train_examples, eval_examples = load_task(cfg)
        evals = eval_examples[: cfg.eval.size]
        # every rank must agree on whether to evaluate: the result is all-reduced
        self.can_eval = bool(evals) and all(e.answer is not None for e in evals)
        self.eval_examples = evals[self.rank :: self.world]
        # with scorers the reward model lives on their devices, not in every controller
        self.reward_fn = None if self.reward_scorers else build_reward(cfg)
        self.stream: PromptStream | PromptShards = (
            PromptShards(self.train_examples, rank=self.rank, world=self.world,
                         shards=self.prompt_shards, seed=cfg.seed, salt="rl")
            if self.prompt_shards else
            PromptStream(self.train_examples, rank=self.rank, world=self.world, seed=cfg.seed, salt="rl"))
        self.sampler = DynamicSampler.from_config(cfg.sampling)
        self.state: dict[str, Any] = {"step": 0, "eval": {}, "warm_start_done": False}

        resume = ckpt.latest_checkpoint(self.run_dir)
        mine = None
        model_dir = str(resume / "policy") if resume else self.model_dir
        device = "cuda" if self.device_type == "gpu" else "cpu"
        self.learner = Learner(cfg, model_dir, device=device, dist_group=self.group)
        if resume is not None:
            lr = self.learner
            shared = ckpt.load_shared(resume, optimizer=None if lr.sharded else lr.optimizer,
                                      scheduler=lr.scheduler, critic_opt=lr.critic_opt)
            lr.load_full_state_dicts(reference=shared.get("reference"), critic=shared.get("critic"))
            self.state = ckpt.read_trainer_state(resume)
            self._drained_step = self.state["step"]  # the driver resumed here: reported through it
            mine = ckpt.load_rank(resume, self.rank)
            if lr.sharded:  # each rank's optimizer shards are in its own file
                assert mine is not None, f"{resume} has no rank{self.rank}.pt: resume with as many ranks"
                lr.load_optimizer_state_dicts(mine["optimizer_shards"])
            if isinstance(self.stream, PromptShards):
                # the last gang may have had another world size: its ranks' shards, merged (only
                # its ranks: a file left in the directory by a gang of another size is stale)
                positions: dict[int, int] = {}
                first = ckpt.load_rank(resume, 0)
                for r in range(int((first or {}).get("world", self.prompt_shards))):
                    saved = first if r == 0 else ckpt.load_rank(resume, r)
                    if saved is not None:
                        positions.update(saved.get("positions", {}))
                self.stream.load_positions(positions)
            elif mine is not None:
                self.stream.position = mine["position"]
            if mine is not None:
                self.sampler.load_state_dict(mine["sampling"])
            self._event("restart" if self.rank == 0 else "resume",
                        f"resumed from checkpoint at step {self.state['step']}",
                        {"resume_step": self.state["step"], "path": str(resume), "rank": self.rank})
        self.engine = None
        self.tensor_parallel = None
        if self.local_sampler:
            from trainer.rollout import make_engine

            seed = cfg.seed + 101 * self.device
            if cfg.rollout.tensor_parallel_size > 1:
                self.tensor_parallel, seed = self._meet_tensor_parallel_group()
            self.engine = make_engine(cfg, model_dir, threads=threads, seed=seed,
                                      tensor_parallel=self.tensor_parallel)
        self.weight_sync.engine = self.engine
        # the rollout workers score a share of their samples with a copy of the frozen reference
        setting = cfg.placement.reference_on_rollout
        self.reference_split: ReferenceSplit | None = None
        self._worker_step: dict[str, float] = {}
        wanted = (self.learner.reference is not None and setting != 0
                  and not (setting == "auto" and self.device_type == "gpu")
                  and (bool(self.rollout_workers) or self.weight_sync.broadcaster is not None))
        # every rank takes part in the reference's broadcast (sharded: its gathers)
        self._reference_out = self.learner.all_reduce_max(int(wanted)) > 0 if self.world > 1 else wanted
        if self._reference_out and self.rollout_workers:
            # a rollout pool smaller than the training pool: ranks share workers round-robin
            # (trainer/placement/disaggregated.py), each worker serving its ranks' calls in turn
            pool = cfg.rollout_pool_size
            sharing = len(range(self.rank % pool, self.world, pool)) if 0 < pool < self.world else 1
            self.reference_split = ReferenceSplit(setting, trainer_cores=self.cores,
                                                  worker_cores=cfg.placement.cpus_per_device,
                                                  ranks_per_worker=sharing)
        if resume is not None and mine is not None:
            ckpt.set_rng_state(mine["rng"])  # last: building an engine reseeds torch

    def _meet_tensor_parallel_group(self) -> tuple[Any, int]:
        """Where this rank's tensor-parallel engine meets and the seed its whole group samples with:
        ranks ``g*tp … g*tp+tp-1`` share engine ``g``; its first rank binds the engine group's
        store (vLLM's env:// rendezvous in this process takes it) and publishes its address (and
        its device, for the seed) in the data-parallel group's store."""
        from trainer.rollout.vllm_engine import TensorParallelGroup

        tp = self.cfg.rollout.tensor_parallel_size
        assert self.group is not None  # tp > 1 divides the devices, so there are ≥ 2 ranks
        engine, shard = divmod(self.rank, tp)
        key = f"yatt-tp-engine-{engine}"
        if shard == 0:
            addr, port = rendezvous.host(library=True)
            self.group.store.set(key, json.dumps([addr, port, self.device]))
        addr, port, device = json.loads(self.group.store.get(key))
        self._event("tensor_parallel", f"rank {self.rank} is shard {shard} of rollout engine {engine}",
                    {"rank": self.rank, "engine": engine, "shard": shard, "size": tp,
                     "device": self.device})
        return TensorParallelGroup(shard, tp, addr, int(port)), self.cfg.seed + 101 * int(device)

    def _ranks_agree_to_draw(self, wants: bool) -> bool:
        """Whether any rank still refills (dynamic sampling): tensor-parallel engines draw together."""
        return self.learner.all_reduce_sum([1.0 if wants else 0.0])[0] > 0

    # ------------------------------------------------------------------ sampling
    def _submit(self, examples: list[Any], n: int) -> _Pending:
        """Split prompts over the local engine and the remote workers; remote ones start now."""
        k = len(examples)
        slots = (1 if self.engine is not None else 0) + len(self.rollout_workers)
        per = [k // slots + (1 if i < k % slots else 0) for i in range(slots)]
        shares, start = [], 0
        for size in per:
            shares.append(examples[start : start + size])
            start += size
        local: list[Any] = shares.pop(0) if self.engine is not None else []
        refs = []
        split = self.reference_split
        for (_dev, worker), share in zip(self.rollout_workers, shares, strict=True):
            rows = split.rows(len(share) * n) if split is not None else 0
            refs.append(worker.generate.remote([e.prompt for e in share], n, rows) if share else None)
        return _Pending(examples, local, refs, shares, self.state["step"],
                        reference_share=split.share if split is not None else 0.0)

    def _collect(self, pending: _Pending, n: int) -> list[Group]:
        import ray

        groups: list[Group] = []
        samples_by_share: list[tuple[list[Any], list[Any], int]] = []
        if pending.local and self.reward_scorers:
            groups.extend(self._generate_and_stream_to_scorers(pending.local, n))
        elif pending.local or self.tensor_parallel is not None:
            # (a tensor-parallel shard takes part in its group's generate with or without prompts)
            assert self.engine is not None
            with self.recorder.span("rollout"):
                self._sampler_turn()
                local_samples = self.engine.generate([e.prompt for e in pending.local], n)
                apply_decode_delay(self.state["step"] + 1, local_samples)  # YATT_SLOW_DECODE
                samples_by_share.append((pending.local, local_samples, 0))
        for ref, share in zip(pending.refs, pending.shares, strict=True):
            if ref is None:
                continue
            t = time.time()
            out = ray.get(ref)
            self.recorder.add("rollout_wait", t, time.time())
            self._remote_spans.extend(out["spans"])
            self._device_metrics.update(out["device_metrics"])
            # versions between the weights that sampled it and the policy it will train
            lag = max(0, self.state["step"] - out["version"]) if out["version"] >= 0 else 0
            self._staleness = max(getattr(self, "_staleness", 0), lag)
            self._note_worker(out, len(share) * n, pending.reference_share)
            samples_by_share.append((share, out["samples"], lag))
        for share, samples, lag in samples_by_share:
            if len(samples) != len(share) * n:
                raise RuntimeError(f"sampler returned {len(samples)} samples for "
                                   f"{len(share)} prompts × n={n}")
            if not share:  # a tensor-parallel shard that sampled for its peers only
                continue
            with self.recorder.span("reward"):
                try:
                    assert self.reward_fn is not None  # remote shares are scored here
                    rewards = self.reward_fn([s.prompt for s in samples],
                                             [s.response_text for s in samples],
                                             [e.answer for e in share for _ in range(n)])
                except Exception as exc:  # a failed scorer marks the step, it does not kill it
                    self._event("warning", f"reward failed on {len(share)} prompts: {exc}",
                                {"step": self.state["step"] + 1})
                    self._reward_failures += 1
                    continue
            for i, e in enumerate(share):
                groups.append(Group(e, samples[i * n : (i + 1) * n], rewards[i * n : (i + 1) * n],
                                    {"staleness": lag}))
        return groups

    def _generate_and_stream_to_scorers(self, share: list[Any], n: int) -> list[Group]:
        """partial_colocate: generate `share` × n samples and send each chunk of finished ones to
        a scorer at once (round-robin over the scorers), so scoring runs during generation; then
        wait for the scores still out. Records the rollout, the scorers' spans and the wait."""
        import ray

        from trainer.rewards.base import checked

        assert self.engine is not None
        total = len(share) * n
        chunk = max(1, math.ceil(total / STREAM_CHUNKS))
        answers = [e.answer for e in share for _ in range(n)]
        samples: list[Any] = [None] * total
        ready: list[int] = []
        calls: list[tuple[list[int], Any]] = []

        def send_ready() -> None:
            nonlocal ready
            if not ready:
                return
            _dev, scorer = self.reward_scorers[(self.rank + self._chunks_sent) % len(self.reward_scorers)]
            self._chunks_sent += 1
            calls.append((ready, scorer.score.remote([samples[i].prompt for i in ready],
                                                     [samples[i].response_text for i in ready],
                                                     [answers[i] for i in ready])))
            ready = []

        self._sampler_turn()
        start = time.time()
        for finished in self.engine.generate_stream([e.prompt for e in share], n):
            for i, sample in finished:
                samples[i] = sample
                ready.append(i)
            if len(ready) >= chunk:
                send_ready()
        generated = time.time()
        send_ready()
        self.recorder.add("rollout", start, generated)
        if any(s is None for s in samples):
            raise RuntimeError(f"sampler streamed {sum(s is not None for s in samples)} samples for "
                               f"{len(share)} prompts × n={n}")
        rewards = [0.0] * total
        failure: Exception | None = None
        for indices, ref in calls:
            try:
                out = ray.get(ref)
                scores = checked(out["scores"], len(indices), "reward scorer")
            except Exception as exc:  # a failed scorer marks the step, it does not kill it
                failure = exc
                continue
            for i, score in zip(indices, scores, strict=True):
                rewards[i] = score
            span = out["span"]
            self._remote_spans.append(span)
            self._stream_stats["scoring"] += span["end"] - span["start"]
            self._stream_stats["overlapped"] += max(0.0, min(span["end"], generated) - span["start"])
        scored = time.time()
        self.recorder.add("reward_wait", generated, scored)
        self._stream_stats["rollout_scored"] += scored - start
        if failure is not None:
            self._event("warning", f"reward failed on {len(share)} prompts: {failure}",
                        {"step": self.state["step"] + 1})
            self._reward_failures += 1
            return []
        return [Group(e, samples[i * n : (i + 1) * n], rewards[i * n : (i + 1) * n], {"staleness": 0})
                for i, e in enumerate(share)]

    def _sampler_turn(self) -> None:
        """Before the local engine generates: colocated on a GPU, the trainer's parameters,
        gradients and optimizer state leave the device, once a step (they stay away through
        dynamic sampling's refills), and the engine wakes."""
        if self._swaps_device and hasattr(self.engine, "sleep") and not self._trainer_away:
            self.learner.release_device()
            self._trainer_away = True
        if hasattr(self.engine, "wake"):
            self.engine.wake()

    def _trainer_turn(self) -> None:
        """Before the step trains, after its last draw: the local engine sleeps
        (`rollout.sleep_level`: at level 2 its weights are gone until the weight sync after this
        step loads the new policy) and the trainer's state comes back to the device."""
        if self.engine is not None and hasattr(self.engine, "sleep"):
            self.engine.sleep()
        if self._trainer_away:
            self.learner.reclaim_device()
            self._trainer_away = False

    def _note_worker(self, out: dict[str, Any], rows: int, share: float) -> None:
        """A worker's generation and reference seconds for one rollout (`ReferenceSplit`)."""
        took = {"rollout": 0.0, "reference": 0.0}
        for span in out["spans"]:
            if span["phase"] in took:
                took[span["phase"]] += span["end"] - span["start"]
        ref_rows = sum(s.ref_logprobs is not None for s in out["samples"])
        seen = self._worker_step
        if took["rollout"] + took["reference"] >= seen.get("busy", -1.0):
            seen.update(busy=took["rollout"] + took["reference"], rollout=took["rollout"],
                        reference=took["reference"], rows=rows, reference_rows=ref_rows)
        seen["share"] = share

    def _draw(self, k: int) -> list[Group]:
        n = self.cfg.rollout.n
        groups = self._collect(self._submit(self.stream.take(k), n), n)
        self._drawn.extend(groups)
        return groups

    def _push_weights(self, version: int, *, reference: bool = False) -> dict[str, float]:
        """The new policy to the samplers (trainer.weight_sync); returns `weight_sync/*`. With
        ``reference``, the frozen reference to the rollout workers' copies (once per run)."""
        streams: list[Iterator[tuple[str, torch.Tensor]]] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            # streamed: one (gathered, when sharded) tensor at a time, never a whole copy
            streams.append(self.learner.iter_named_weights(reference=reference))
            return streams[-1]

        metrics: dict[str, float] = {}
        if self.weight_sync.broadcaster is not None if reference else self.weight_sync.has_destination:
            metrics, spans = self.weight_sync.push(version, weights, reference=reference)
            self.recorder.extend(spans)
        elif self.learner.sharded:
            weights()
        for stream in streams:  # sharded: every rank runs every gather, whether it sends or not
            drain_weights(stream)
        return metrics

    def _gather_sync_spans(self) -> None:
        """Weight-sync spans of the workers that have finished loading (never blocks)."""
        self._remote_spans.extend(self.weight_sync.receiver_spans())

    # ------------------------------------------------------------------ phases
    def _warm_start(self) -> None:
        ws = self.cfg.algorithm.warm_start
        if ws.steps == 0 or self.cfg.algorithm.name == "sft" or self.state["warm_start_done"]:
            return
        from trainer.warm_start import run_warm_start

        with self.recorder.span("warm_start"):
            res = run_warm_start(self.learner, self.train_examples, ws, rank=self.rank,
                                 world=self.world, seed=self.cfg.seed,
                                 max_new_tokens=self.cfg.rollout.max_new_tokens, emit=self._emit)
        self.learner.sync_reference_to_policy()  # KL is measured from the warmed-up policy
        self.state["warm_start_done"] = True
        self.recorder.take()
        metrics = {"warm_start/time_s": res.time_s, "warm_start/steps": float(res.steps)}
        if res.dev_accuracy is not None:
            metrics["warm_start/dev_accuracy"] = res.dev_accuracy
            metrics["warm_start/reached_target"] = float(bool(res.reached_target))
            if self.rank == 0:
                how = "reached" if res.reached_target else "missed (step budget spent)"
                self._event("warm_start", f"warm start stopped after {res.steps}/{ws.steps} steps: "
                            f"dev accuracy {res.dev_accuracy:.3f}, target {ws.target_accuracy} {how}",
                            {"steps": res.steps, "budget": ws.steps, "dev_accuracy": res.dev_accuracy,
                             "target_accuracy": ws.target_accuracy,
                             "reached_target": res.reached_target, "time_s": res.time_s})
        self._emit({"type": "metrics", "step": 0, "metrics": metrics})

    def _evaluate(self, when: str) -> float | None:
        from trainer.rewards import exact_match

        if not self.can_eval:
            return None
        t = time.time()
        with self.recorder.span("eval"):
            texts = self.learner.greedy([e.prompt for e in self.eval_examples],
                                        self.cfg.rollout.max_new_tokens)
            scores = exact_match([e.prompt for e in self.eval_examples], texts,
                                 [e.answer for e in self.eval_examples])
        correct, total = self.learner.all_reduce_sum([sum(scores), float(len(scores))])
        acc = correct / max(total, 1.0)
        self.state["eval"][f"accuracy_{when}"] = acc
        if self.rank == 0:
            self._event("eval", f"held-out accuracy at {when}: {acc:.3f}",
                        {"when": when, "accuracy": acc, "n": total, "step": self.state["step"],
                         "time_s": time.time() - t})
        return acc

    def _checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        path = ckpt.checkpoint_dir(self.run_dir, step)
        with self.recorder.span("checkpoint"):
            lr = self.learner
            full = lr.full_state_dicts()  # sharded: every rank gathers, rank 0 keeps
            if self.rank == 0:
                ckpt.save_shared(path, policy=lr.policy, tokenizer=lr.tokenizer,
                                 optimizer=None if lr.sharded else lr.optimizer,
                                 scheduler=lr.scheduler, critic=full["critic"],
                                 critic_opt=None if lr.sharded else lr.critic_opt,
                                 reference=full["reference"], policy_state=full["policy"])
            if self.group is not None:
                self.group.barrier()  # rank 0 created the directory
            # prompts prefetched for later steps are not trained yet: a resume takes them again
            prefetch = getattr(self, "_prefetch", None)
            stream = prefetch[0].stream_before if prefetch else self._stream_state()
            state = {"position": sum(stream.values()) if isinstance(stream, dict) else stream,
                     "sampling": self.sampler.state_dict(), "rng": ckpt.rng_state()}
            if isinstance(stream, dict):
                state["positions"], state["world"] = stream, self.world
            if lr.sharded:  # each rank's optimizer shards go in its own file
                state["optimizer_shards"] = lr.optimizer_state_dicts()
            ckpt.save_rank(path, self.rank, state)
            if self.group is not None:
                self.group.barrier()
            if self.rank == 0:
                ckpt.mark_complete(path, {**self.state, "step": step})
                ckpt.prune(self.run_dir, self.cfg.checkpoint.keep, reported_through=self._drained_step)
                self._emit({"type": "checkpoint", "step": step, "path": str(path),
                            "size_bytes": ckpt.dir_size(path), "metrics": metrics})

    # ------------------------------------------------------------------ the loop
    def run(self, master_addr: str, master_port: int, *, close_engine: bool = True) -> dict[str, Any]:
        """Train to the end (or to a stop the driver asked for); returns this rank's result.

        ``close_engine=False``: leave the rollout engine open at the end of the run, for a caller
        whose process ends right after (the Ray actor: the driver kills the gang as soon as every
        rank's result is in). vLLM's shutdown takes 1.6 s of a one-core process (three garbage
        collections over a heap vLLM no longer keeps frozen), which would only delay the result.
        A stop for a re-plan still closes it: the next gang starts on the same devices."""
        try:
            return self._run(master_addr, master_port, close_engine)
        except Exception as exc:
            self._event("warning", f"controller {self.rank} failed: {exc}",
                        {"traceback": traceback.format_exc()[-4000:]})
            raise

    def _run(self, master_addr: str, master_port: int, close_engine: bool) -> dict[str, Any]:
        cfg = self.cfg
        self._setup(master_addr, master_port)
        self._warm_start()
        if self._reference_out:  # after the warm start, which moves the reference
            self._push_weights(self.state["step"], reference=True)
        self._push_weights(self.state["step"])
        if "accuracy_start" not in self.state["eval"]:
            self._evaluate("start")
        self.recorder.take()
        algo = cfg.algorithm.name
        need = cfg.train.batch_size // self.world
        n = cfg.rollout.n
        prefetch: deque[_Pending] = deque()
        self._prefetch = prefetch
        overlap = bool(self.rollout_workers) and self.engine is None and cfg.placement.staleness > 0
        self._staleness = 0
        for step in range(self.state["step"] + 1, cfg.train.max_steps + 1):
            self.recorder.step = step
            self._reward_failures = 0
            t0 = time.time()
            metrics: dict[str, float] = {}
            if algo == "sft":
                from trainer.data import sft_target

                batch = self.stream.take(need)
                with self.recorder.span("train"):
                    m = self.learner.sft_step([e.prompt for e in batch],
                                              [sft_target(e) for e in batch], self.learner.optimizer)
                    m["lr"] = self.learner.scheduler.get_last_lr()[0]
                    self.learner.scheduler.step()
                metrics.update(m)
                gen_tokens = 0
                samples_n = len(batch)
            else:
                first = None
                self._drawn: list[Group] = []  # every group sampled this step, kept or not
                if prefetch:
                    first = self._collect(prefetch.popleft(), n)
                    self._drawn.extend(first)
                groups, smetrics = self.sampler.fill(
                    need, self._draw, first=first,
                    agree=self._ranks_agree_to_draw if self.tensor_parallel is not None else None)
                metrics.update(smetrics)
                if overlap:  # start the next rollouts now: they run while this step trains
                    while len(prefetch) < cfg.placement.staleness and step + len(prefetch) < cfg.train.max_steps:
                        before = self._stream_state()
                        prefetch.append(self._submit(self.stream.take(self.sampler.request_size(need)), n))
                        prefetch[-1].stream_before = before
                samples = [s for g in groups for s in g.samples]
                rewards = [r for g in groups for r in g.rewards]
                batch = RLBatch(prompt_ids=[list(s.prompt_ids) for s in samples],
                                response_ids=[list(s.response_ids) or [self.learner.eos_id] for s in samples],
                                scores=rewards, n=n,
                                truncated=[s.finish_reason == "length" for s in samples],
                                sample_logprobs=[list(s.logprobs) for s in samples],
                                staleness=[g.extra.get("staleness", 0) for g in groups for _ in g.samples],
                                ref_logprobs=([list(s.ref_logprobs or []) for s in samples]
                                              if any(s.ref_logprobs for s in samples) else None))
                self._trainer_turn()
                with self.recorder.span("train"):
                    metrics.update(self.learner.rl_step(batch, recorder=self.recorder))
                metrics.update(self._push_weights(step))
                # rewards and lengths describe everything sampled this step (dropped groups too)
                drawn = [s for g in self._drawn for s in g.samples]
                rewards = [r for g in self._drawn for r in g.rewards]
                lengths = [len(s.response_ids) for s in drawn]
                gen_tokens = sum(lengths)
                samples_n = len(drawn)
                if drawn:
                    mean = sum(rewards) / len(rewards)
                    metrics.update({
                        "reward/mean": mean,
                        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
                        "reward/max": max(rewards), "reward/min": min(rewards),
                        "response/length_mean": gen_tokens / len(lengths),
                        "response/length_max": float(max(lengths)),
                        "response/length_min": float(min(lengths)),
                        "response/truncated_frac":
                            sum(s.finish_reason == "length" for s in drawn) / len(drawn),
                    })
                metrics["reward/failed_batches"] = float(self._reward_failures)
                # text a model generated may hold NUL, which no database stores (the API would
                # refuse the whole events batch): such samples are not among those shown
                scored_samples = [{"prompt": s.prompt, "response": s.response_text, "reward": r}
                                  for g in self._drawn for s, r in zip(g.samples, g.rewards, strict=True)
                                  if "\x00" not in s.prompt + s.response_text]
                self._scored_samples = scored_samples[:SCORED_SAMPLES_KEPT]
                metrics["sampling/staleness"] = float(self._staleness)
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.max_steps:
                acc = self._evaluate(f"step_{step}")
                if acc is not None:
                    metrics["eval/accuracy"] = acc
            step_end = time.time()
            metrics.update(self._step_metrics(step, t0, step_end, gen_tokens, samples_n,
                                              metrics.pop("trained_tokens", 0.0)))
            self._split_reference(metrics)
            self.state["step"] = step
            spans = self.recorder.take()
            self._emit({"type": "metrics", "step": step, "metrics": metrics,
                        "spans": [s.to_dict() for s in spans],
                        "scored_samples": getattr(self, "_scored_samples", [])})
            last = step == cfg.train.max_steps
            scheduled = step % cfg.checkpoint.every_steps == 0 or last
            if scheduled:
                self._checkpoint(step, {k: v for k, v in metrics.items() if k.startswith("reward/")})
            if self.stoppable and not last and self._agree_to_stop():
                # re-plan: the next gang resumes from this step's checkpoint (prefetched prompts
                # are not trained yet, so the checkpoint's stream position puts them back)
                if not scheduled:
                    self._checkpoint(step, {k: v for k, v in metrics.items() if k.startswith("reward/")})
                if self.engine is not None:
                    self.engine.close()
                return {"rank": self.rank, "step": step, "eval": self.state["eval"], "stopped": True}
        self._evaluate("end")
        if cfg.checkpoint.export_final:
            final = self.learner.full_state_dicts()["policy"]  # sharded: a collective
            if self.rank == 0:
                ckpt.export_final(self.run_dir / "final", policy=self.learner.policy,
                                  tokenizer=self.learner.tokenizer, state_dict=final)
        if self.engine is not None and close_engine:
            self.engine.close()
        return {"rank": self.rank, "step": self.state["step"], "eval": self.state["eval"]}

    def _split_reference(self, metrics: dict[str, float]) -> None:
        """Feed this step's phase times to the reference split; report the share it ran with."""
        split, seen = self.reference_split, self._worker_step
        self._worker_step = {}
        if split is None or not seen:
            return
        metrics["placement/reference_on_rollout"] = seen["share"]
        metrics["time/reference_rollout"] = seen["reference"]
        split.observe(worker_rollout_s=seen["rollout"], worker_reference_s=seen["reference"],
                      worker_rows=int(seen["rows"]), worker_reference_rows=int(seen["reference_rows"]),
                      workers=len(self.rollout_workers),
                      trainer_busy_s=metrics["time/step"] - metrics.get("time/rollout_wait", 0.0),
                      trainer_reference_s=metrics.get("time/reference", 0.0),
                      trainer_reference_rows=int(metrics.get("reference/rows", 0.0)))

    def _stream_state(self) -> int | dict[int, int]:
        s = self.stream
        return s.positions() if isinstance(s, PromptShards) else s.position

    def _step_metrics(self, step: int, t0: float, t1: float, gen_tokens: int, samples_n: int,
                      trained_tokens: float) -> dict[str, float]:
        self._gather_sync_spans()
        remote = self._remote_spans
        self._remote_spans = []
        self.recorder.extend(remote)
        spans = self.recorder._spans
        mine = PhaseRecorder.durations(spans, device=self.device)
        wall = max(t1 - t0, 1e-9)
        out: dict[str, float] = {"time/step": wall}
        for phase in ("rollout", "rollout_wait", "reward", "reference", "train", "weight_sync",
                      "eval", "checkpoint"):
            out[f"time/{phase}"] = mine.get(phase, 0.0)
        if self.reward_scorers:  # partial_colocate: scoring ran on the scorers' devices
            stats = self._stream_stats
            out["time/reward"] = stats["scoring"]  # scorer time for this rank's samples
            out["time/reward_wait"] = mine.get("reward_wait", 0.0)  # scoring left after generation
            out["time/rollout_scored"] = stats["rollout_scored"]
            out["placement/scoring_overlap_frac"] = (stats["overlapped"] / stats["scoring"]
                                                     if stats["scoring"] else 0.0)
            self._stream_stats = dict.fromkeys(stats, 0.0)
        else:  # generation, then scoring, in turn
            out["time/rollout_scored"] = mine.get("rollout", 0.0) + mine.get("reward", 0.0)
        out["time/reference"] = mine.get("reference", 0.0)
        out["time/train"] = max(0.0, out["time/train"] - out["time/reference"])  # nested span
        busy = sum(v for k, v in mine.items() if k not in ("reference", "rollout_wait", "reward_wait"))
        out["time/idle"] = max(0.0, wall - busy)
        rollout_time = max(mine.get("rollout", 0.0),
                           sum(s.end - s.start for s in spans
                               if s.phase == "rollout" and s.device != self.device))
        out["time/rollout"] = rollout_time  # on this device, or on the rollout workers it feeds from
        out["throughput/gen_tokens_per_s"] = gen_tokens / rollout_time if rollout_time else 0.0
        out["throughput/tokens_per_s"] = gen_tokens / wall
        out["throughput/samples_per_s"] = samples_n / wall
        train_t = out["time/train"] + out["time/reference"]
        out["throughput/trained_tokens_per_s"] = trained_tokens / train_t if train_t else 0.0
        out["tokens/generated"] = float(gen_tokens)
        out["tokens/trained"] = float(trained_tokens)
        dm = self.monitor.sample()
        dm[f"device/{self.device}/busy_frac"] = PhaseRecorder.busy_fraction(
            [s for s in spans if s.phase not in ("rollout_wait", "reward_wait")], self.device, t0, t1)
        # A rollout worker's spans arrive a step late (prefetched while this step trained), so
        # its busy fraction is its busy time per step of this controller, not a clipped window.
        for d in {s.device for s in spans if s.device != self.device}:
            busy_d = sum(s.end - s.start for s in spans if s.device == d)
            dm[f"device/{d}/busy_frac"] = min(1.0, busy_d / wall)
        dm.update(self._device_metrics)
        self._device_metrics = {}
        out.update(dm)
        return out
