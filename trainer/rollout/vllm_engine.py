"""vLLM as the sampler, in the caller's process (a controller actor owns its engine).

Facts from the installed vLLM (0.32, CPU build) this relies on:
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in-process (start in seconds,
  and ``collective_rpc`` reaches the worker directly, so tensors pass by reference).
- The model's own ``load_weights`` breaks once the CPU backend has processed its weights;
  the worker's ``reload_weights(weights_iterator=...)`` (``vllm.model_executor.model_loader.
  reload.inplace``) re-runs the layer-wise load and post-processing and mostly works. Not for
  layers whose vocabulary is padded (embedding, LM head): their weights are copied, but the
  packed copy the CPU GEMM closure (``layer.cpu_linear``) captured at load time is not rebuilt,
  so a tied LM head keeps computing logits with the *old* embeddings (measured: greedy output
  diverged from transformers'). ``_repack_cpu_gemm_weights`` rebuilds those closures.
  That reload re-creates every layer on the meta device and runs its loaders again, ~1.7x the
  time of the copies and packing themselves (bench/engine_load.py); for the architectures in
  ``IN_PLACE_ARCHITECTURES`` a one-process CPU engine loads by ``_load_cpu_in_place`` instead,
  which leaves every parameter bit for bit where the reload does.
  After a reload the prefix cache holds KV computed with old weights, so it is reset.
- On CPU, ``LLM.sleep`` is a no-op (``CPUWorker.sleep`` only logs): the KV cache stays
  allocated, sized up front by ``rollout.kv_cache_gb`` (``kv_cache_memory_bytes``, the setting
  ``VLLM_CPU_KVCACHE_SPACE`` feeds), and zeroed at start: a yatt engine allocates no more than
  its scheduler can fill (``trainer.placement.memory.cpu_kv_cache_bytes``). On GPUs sleep
  frees the KV cache and offloads the weights to host memory (`rollout.sleep_level` 1) or
  discards them (2), since the next weight sync overwrites them anyway (`EngineSleep`).
- Its CPU platform runs every RMSNorm through the native (PyTorch) form of vLLM's IR ops although
  the CPU build carries fused C++ kernels for them; an eager CPU engine puts those first
  (``vllm_cpu_norms.py``: 15% of a colocated rollout's time on the `small` model).
- Asked for log-probs, its sampler counts each sampled token's rank with a function under
  ``torch.compile`` (Inductor on CPU), compiled on the engine's first generate: 1.3 s with
  Inductor's cache warm, 10.8 s cold. A CPU engine counts eagerly at a small vocabulary instead
  (``vllm_cpu_ranks.py``).
- With ``rollout.compile`` it saves the compiled model under ``$VLLM_CACHE_ROOT`` for the next
  engine of the same configuration, but on a CPU the load always failed and the engine compiled
  again (20-24 s on the `small` model); ``vllm_cpu_aot.py`` makes it load (6 s, eager 3 s).
- Asked for log-probs, it keeps a dict and a ``Logprob`` object per generated token unless
  ``flat_logprobs``, and while detokenizing it also decodes the token of each log-prob entry, all
  in Python on the engine's thread: 7-9% of a one-core rollout of the `small` model (32 and 256
  new tokens). yatt asks for flat log-probs and leaves detokenization off unless stop strings
  need vLLM's text; ``_sample`` decodes each finished sample's ids once.
- The CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process; the
  engine restores it so a colocated trainer can still size its thread pool.
- Tensor parallelism (``rollout.tensor_parallel_size``) runs through vLLM's external launcher
  (``distributed_executor_backend="external_launcher"``): each process of the group builds the
  same ``LLM`` and holds its shard; vLLM's default torch.distributed group is then the engine's
  group (env:// rendezvous), every rank must submit the same requests with the same seed, and
  each computes the same outputs. ``reload_weights`` given the *whole* tensors loads each rank's
  shard (the layers' weight loaders slice them), and the greedy output then equals
  ``transformers``' token for token (measured on vLLM-CPU 0.32, TP=2, gloo).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import TrainerConfig
from trainer.rollout.base import SLEEP_TAGS, Sample


def _repack_cpu_gemm_weights(worker) -> int:
    """Rebuild the packed GEMM weights of CPU layers that keep their weight (embedding, LM head)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = 0
    for module in worker.model_runner.get_model().modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor)
                and weight.dim() == 2 and weight.numel() > 0):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


# Architectures whose CPU in-place load (`_load_cpu_in_place`) is checked against vLLM's own reload
# (tests/integration/test_models_rollout.py: greedy output equal to transformers' after an update).
IN_PLACE_ARCHITECTURES = frozenset({"Qwen2ForCausalLM"})


def _in_place_supported(worker) -> bool:
    """Whether the worker's model can take `_load_cpu_in_place`: a listed architecture whose
    linear layers are all unquantized (their weights packed for the CPU GEMM at load)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    model = worker.model_runner.get_model()
    if type(model).__name__ not in IN_PLACE_ARCHITECTURES:
        return False
    return all(isinstance(m.quant_method, UnquantizedLinearMethod)
               for m in model.modules() if isinstance(m, LinearBase))


def _load_cpu_in_place(worker, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load HF-named whole tensors into a CPU model without vLLM's layer-wise reload.

    The reload (``reload_weights``) re-creates every layer's parameters on the meta device and
    re-runs each weight loader and post-processing: 1.5-1.7x this load's time (71 against 41 ms
    for the 17M `small` model on one core; bench/engine_load.py). Here, with one engine on one
    process (no tensor parallelism): a fused layer (``packed_modules_mapping``: q/k/v into
    ``qkv_proj``, gate/up into ``gate_up_proj``) gets its parts concatenated in mapping order,
    every linear layer gets its new weight and bias and then the same
    ``process_weights_after_loading`` the first load ran (the CPU GEMM's packing), and the other
    parameters (norms, the embedding, whose rows past the vocabulary are padding, zeroed as
    vLLM's loader zeroes them) are copied into.
    Returns the number of tensors loaded; raises KeyError for a name the model does not have,
    and ValueError when a layer was left without some of its parts.
    """
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.get_model()
    modules = dict(model.named_modules())
    parts = {src: (fused, i, len(srcs)) for fused, srcs in model.packed_modules_mapping.items()
             for i, src in enumerate(srcs)}
    pending: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    staged: dict[str, dict[str, torch.Tensor]] = {}  # linear layer -> its new weight/bias
    loaded = 0
    tied_head = getattr(getattr(model, "lm_head", None), "weight", None) is getattr(
        modules.get("model.embed_tokens"), "weight", False)

    def param(path: str, kind: str) -> torch.nn.Parameter:
        module = modules.get(path)
        if module is None or not isinstance(getattr(module, kind, None), torch.Tensor):
            raise KeyError(f"no parameter for {path}.{kind} in {type(model).__name__}")
        return getattr(module, kind)

    def put(path: str, kind: str, tensor: torch.Tensor) -> None:
        target = param(path, kind)
        if isinstance(modules[path], LinearBase):
            # in the dtype the layer holds it in now (a packed weight's empty stand-in has the
            # model's; a bias the CPU GEMM wants in fp32 already is), as vLLM's reload does
            staged.setdefault(path, {})[kind] = tensor.to(target.dtype)
            return
        if tied_head and path == "lm_head":
            return  # the embedding's own weight, loaded under its name
        target.data[: tensor.shape[0]].copy_(tensor)
        target.data[tensor.shape[0]:].zero_()  # the padding, as vLLM's own loader leaves it

    for name, tensor in weights_iterator:
        loaded += 1
        path, _, kind = name.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        if leaf not in parts:
            put(path, kind, tensor)
            continue
        fused, i, k = parts[leaf]
        target = f"{parent}.{fused}"
        slots = pending.setdefault((target, kind), [None] * k)
        slots[i] = tensor.to(param(target, kind).dtype)
        if all(t is not None for t in slots):
            put(target, kind, torch.cat(slots))  # type: ignore[arg-type]
            del pending[(target, kind)]
    if pending:
        raise ValueError(f"incomplete fused layers: {sorted(f'{p}.{k}' for p, k in pending)}")
    for path, new in staged.items():
        module = modules[path]
        if "weight" not in new:
            raise ValueError(f"{path}: a bias without its weight")
        for kind, tensor in new.items():  # the layer's own parameter objects keep their class
            getattr(module, kind).data = tensor
        module.quant_method.process_weights_after_loading(module)
    return loaded


def _sample(prompt: str, out, completion, tokenizer=None) -> Sample:
    """A yatt sample from vLLM's RequestOutput and one of its CompletionOutputs. ``tokenizer``:
    the request was not detokenized (``SamplingParams.detokenize=False``): the text is decoded
    here, once, from the token ids."""
    ids = list(completion.token_ids)
    lp = completion.logprobs  # flat (`_params`), logprobs=0: one entry a position, the sampled token's
    if lp is None or lp.token_ids != ids or lp.end_indices != list(range(1, len(ids) + 1)):
        raise RuntimeError("vLLM's flat log-probs do not line up with the sampled tokens")
    text = completion.text if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)
    return Sample(
        prompt=prompt,
        prompt_ids=list(out.prompt_token_ids or []),
        response_ids=ids,
        response_text=text,
        logprobs=list(lp.logprobs),
        finish_reason="length" if completion.finish_reason == "length" else "stop",
    )


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in a tensor-parallel engine and where the group meets (env://)."""

    rank: int
    size: int
    master_addr: str
    master_port: int


class EngineSleep:
    """What a colocated vLLM engine on a GPU gives back while the trainer uses the device.

    ``sleep`` puts the engine to sleep at `rollout.sleep_level`: 1 offloads its weights to host
    memory and discards the KV cache; 2 discards both, which a colocated policy can afford, since
    the weight sync after every training step overwrites all of them (no host copy of the
    weights, and no copy back at wake-up). ``wake`` brings back the parts named, and only those
    still asleep: a weight load wakes ``weights`` alone, a generate everything (``ready``). After
    a level-2 sleep the weights' memory holds nothing until a load: ``ready`` refuses to generate
    from it. A sleep while a part is still asleep is skipped (the weights a sync woke stay awake
    until the next generate wakes the cache; vLLM's executor would release them again, and its
    scheduler resumes only once every part is awake). ``active`` is False
    on vLLM's CPU backend, whose sleep is a no-op, and then nothing is ever asleep.
    """

    def __init__(self, llm: Any, level: int, *, active: bool):
        self.llm, self.level, self.active = llm, level, active
        self.asleep: set[str] = set()
        self.weights_lost = False

    def sleep(self) -> None:
        if self.active and not self.asleep:
            self.llm.sleep(level=self.level)
            self.asleep = set(SLEEP_TAGS)
            self.weights_lost = self.level >= 2

    def wake(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        todo = [t for t in SLEEP_TAGS if t in tags and t in self.asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self.asleep.difference_update(todo)

    def loaded(self) -> None:
        """A full set of weights has been loaded since the last sleep."""
        self.weights_lost = False

    def ready(self) -> None:
        """Before a generate: everything awake, from weights that hold a policy."""
        if self.weights_lost:
            raise RuntimeError("the rollout engine's weights were discarded by a level-2 sleep "
                               "(rollout.sleep_level=2) and no policy has been loaded since; "
                               "load one (update_weights) before generating")
        self.wake()


class VLLMEngine:
    """An in-process ``vllm.LLM`` behind the RolloutEngine interface.

    With ``tensor_parallel`` the engine is one shard of an engine spread over the group's
    processes: ``generate`` is then a collective of the group (each rank passes its own prompts,
    possibly none, and gets back its own samples), and so is ``update_weights``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainerConfig,
        *,
        threads: int = 1,
        seed: int | None = None,
        device: str = "cpu",
        tensor_parallel: TensorParallelGroup | None = None,
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_gpu = device.startswith("cuda")
        tp = tensor_parallel
        if tp is not None:
            # the external launcher's env:// rendezvous; on a GPU each actor sees only its own
            # device (CUDA_VISIBLE_DEVICES), so its local index is 0
            os.environ.update(RANK=str(tp.rank), WORLD_SIZE=str(tp.size),
                              LOCAL_RANK="0" if on_gpu else str(tp.rank),
                              MASTER_ADDR=tp.master_addr, MASTER_PORT=str(tp.master_port))
        if not on_gpu:
            # An explicit OMP_NUM_THREADS keeps vLLM from dropping torch to one thread.
            os.environ["OMP_NUM_THREADS"] = str(threads)
            # The legacy variable overrides kv_cache_memory_bytes and only takes whole GiB.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            torch.set_num_threads(threads)
        from vllm import LLM

        from trainer.precision import sampler_dtype

        r = cfg.rollout
        kwargs: dict[str, object] = {
            "model": str(model_dir),
            "dtype": sampler_dtype(cfg, device),
            "seed": cfg.seed if seed is None else seed,
            "trust_remote_code": cfg.model.trust_remote_code,
            "logprobs_mode": "processed_logprobs",  # log-probs of the distribution sampled from
        }
        if tp is not None:
            kwargs.update(tensor_parallel_size=tp.size, distributed_executor_backend="external_launcher")
            if not on_gpu:  # shared-memory segments named per group (see that module)
                kwargs["worker_cls"] = "trainer.rollout.vllm_cpu_shard.ShardCPUWorker"
        if on_gpu:
            kwargs.update(gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep_mode=True)
        else:
            # eager unless `rollout.compile` (its first engine of a configuration compiles, 20-36 s
            # here; later ones load the saved model)
            from trainer.placement.memory import cpu_kv_cache_bytes, cpu_max_num_seqs, read_shape

            # the cache allocated and zeroed now: no more than the scheduler's sequences can fill,
            # and the scheduler runs no more sequences than one of the run's generates holds
            kwargs.update(enforce_eager=not r.compile, max_num_seqs=cpu_max_num_seqs(cfg),
                          kv_cache_memory_bytes=cpu_kv_cache_bytes(cfg, read_shape(str(model_dir))))
            if r.compile and os.environ.get("YATT_VLLM_CPU_AOT", "1") != "0":
                # load the compiled model saved by an earlier engine of this configuration
                # instead of compiling it again (vllm_cpu_aot.py); YATT_VLLM_CPU_AOT=0: compile
                from trainer.rollout import vllm_cpu_aot

                vllm_cpu_aot.install()
            # eager: the norms through vLLM-CPU's C++ kernels instead of its native PyTorch path
            # (vllm_cpu_norms.py); YATT_VLLM_CPU_NORMS=0 keeps them native (bench/trainer_vs_trl A/B)
            if not r.compile and os.environ.get("YATT_VLLM_CPU_NORMS", "1") != "0":
                from trainer.rollout import vllm_cpu_norms

                priority = vllm_cpu_norms.register()
                if priority is not None:
                    kwargs["ir_op_priority"] = priority
            # the sampled token's rank counted eagerly at a small vocabulary, instead of compiled
            # with Inductor on the first generate (vllm_cpu_ranks.py: 1.3-10.8 s an engine);
            # YATT_VLLM_CPU_EAGER_RANKS=0 keeps vLLM's compiled count
            if os.environ.get("YATT_VLLM_CPU_EAGER_RANKS", "1") != "0":
                from trainer.rollout import vllm_cpu_ranks

                vllm_cpu_ranks.install()
        set_num_threads = torch.set_num_threads
        try:
            self.llm = LLM(**kwargs)  # type: ignore[arg-type]
        finally:
            torch.set_num_threads = set_num_threads
        self.tokenizer = self.llm.get_tokenizer()
        self.rollout = r
        self.on_gpu = on_gpu
        self.tensor_parallel = tp
        self._sleep = EngineSleep(self.llm, r.sleep_level, active=on_gpu)
        self._in_place: bool | None = None  # `_load_cpu_in_place` fits this model (first update)

    @property
    def sleep_supported(self) -> bool:
        """Whether ``sleep`` frees memory (GPU) or is a no-op (vLLM's CPU backend)."""
        return self.on_gpu

    def _params(self, n: int):  # -> vllm.SamplingParams
        from vllm import SamplingParams

        r = self.rollout
        return SamplingParams(
            n=n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_new_tokens,
            stop=list(r.stop) or None,
            logprobs=0,  # the sampled token's log-prob only
            # in a few flat lists a request, not a dict and a Logprob object per token
            flat_logprobs=True,
            skip_special_tokens=True,
            # stop strings are matched on the text vLLM builds as it goes; without them the text
            # is decoded once per sample at the end (_sample), not token by token with each
            # token's log-prob entry decoded too
            detokenize=bool(r.stop),
        )

    def _gather_prompts(self, prompts: list[str]) -> tuple[list[str], int]:
        """Tensor parallel: every rank's prompts in rank order, and where this rank's start."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_world_group

        assert self.tensor_parallel is not None
        everyone: list[list[str] | None] = [None] * self.tensor_parallel.size
        dist.all_gather_object(everyone, list(prompts), group=get_world_group().cpu_group)
        before = sum(len(p or []) for p in everyone[: self.tensor_parallel.rank])
        return [p for ps in everyone for p in ps or []], before

    def generate(self, prompts: list[str], n: int) -> list[Sample]:
        if self.tensor_parallel is None:
            return self._generate(prompts, n)
        # the group samples everyone's prompts together (same requests, same seed on each rank)
        every, before = self._gather_prompts(prompts)
        samples = self._generate(every, n) if every else []
        return samples[before * n : (before + len(prompts)) * n]

    def _generate(self, prompts: list[str], n: int) -> list[Sample]:
        self._sleep.ready()
        params = self._params(n)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples, decoder = [], None if params.detokenize else self.tokenizer
        for prompt, out in zip(prompts, outputs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                samples.append(_sample(prompt, out, c, decoder))
        return samples

    def generate_stream(self, prompts: list[str], n: int) -> Iterator[list[tuple[int, Sample]]]:
        """The same samples as ``generate``, handed out as they finish: after each engine step,
        the (index, sample) pairs that finished in it (index ``i * n + j``: prompt i's j-th).

        Each sample is its own request (n=1), so a short response is out as soon as it ends
        instead of waiting for its prompt's longest sibling."""
        if self.tensor_parallel is not None:
            raise NotImplementedError("generate_stream with rollout.tensor_parallel_size > 1")
        self._sleep.ready()
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("generate_stream needs an idle engine")
        expanded = [p for p in prompts for _ in range(n)]
        params = self._params(1)
        decoder = None if params.detokenize else self.tokenizer
        request_ids = self.llm.enqueue(expanded, params, use_tqdm=False)
        # enqueue answers the engine's internal ids ("<id>-<random>"); outputs carry "<id>"
        index = {str(rid): i for i, rid in enumerate(request_ids)}
        index.update({str(rid).rsplit("-", 1)[0]: i for i, rid in enumerate(request_ids)})
        while engine.has_unfinished_requests():
            finished = []
            for out in engine.step():
                if out.finished:
                    i = index[str(out.request_id)]
                    finished.append((i, _sample(expanded[i], out, out.outputs[0], decoder)))
            if finished:
                yield finished

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # the weights' memory back first, the KV cache only at the next generate (vLLM's order for
        # RLHF: the trainer's tensors and the cache are never on the device at once)
        self._sleep.wake(("weights",))
        weights = ((name, t.detach()) for name, t in named_tensors)
        if self._in_place is None:
            self._in_place = (not self.on_gpu and self.tensor_parallel is None
                              and self.llm.collective_rpc(_in_place_supported)[0])
        if self._in_place:
            self.llm.collective_rpc(_load_cpu_in_place, kwargs={"weights_iterator": weights})
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.on_gpu:
            self.llm.collective_rpc(_repack_cpu_gemm_weights)
        self.llm.reset_prefix_cache()
        self._sleep.loaded()

    def sleep(self) -> None:
        self._sleep.sleep()

    def wake(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        self._sleep.wake(tags)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del self.llm
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
            gc.collect()
