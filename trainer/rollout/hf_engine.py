"""``transformers.generate`` as the sampler: the fallback when vLLM is missing or unsuitable."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from trainer.config import TrainerConfig
from trainer.rollout.base import SLEEP_TAGS, FinishReason, Sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    """Its own copy of the policy, sampled with ``generate``; same Sample semantics as vLLM's."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainerConfig,
        *,
        seed: int | None = None,
        device: str = "cpu",
        chunk_size: int = 256,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainer.precision import sampler_dtype

        self.tokenizer = AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=cfg.model.trust_remote_code
        )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=_DTYPES[sampler_dtype(cfg, device)],
            trust_remote_code=cfg.model.trust_remote_code,
        ).to(device)
        self.model.eval()
        self.device = device
        self.rollout = cfg.rollout
        self.chunk_size = chunk_size  # sequences per generate call
        self.eos_ids = self._eos_ids()
        self.generator_seed = cfg.seed if seed is None else seed
        torch.manual_seed(self.generator_seed)

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _finish(self, prompt: str, prompt_ids: list[int], ids: list[int],
                logprobs: list[float]) -> Sample:
        """Cut a padded generation at EOS or the first stop string, like vLLM does."""
        finish: FinishReason = "length"
        for i, tok in enumerate(ids):
            if tok in self.eos_ids:
                ids, logprobs, finish = ids[: i + 1], logprobs[: i + 1], "stop"
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if finish == "length" and self.rollout.stop:
            hits = [(text.find(s), s) for s in self.rollout.stop if s in text]
            if hits:
                cut, stop = min(hits)
                text = text[:cut]
                # keep tokens up to the one that completed the stop string
                for k in range(1, len(ids) + 1):
                    if stop in self.tokenizer.decode(ids[:k], skip_special_tokens=True):
                        ids, logprobs = ids[:k], logprobs[:k]
                        break
                finish = "stop"
        return Sample(prompt=prompt, prompt_ids=prompt_ids, response_ids=ids, response_text=text,
                      logprobs=logprobs, finish_reason=finish)

    @torch.inference_mode()
    def _generate_chunk(self, prompts: list[str], n: int) -> list[Sample]:
        r = self.rollout
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(self.device)
        sampling = r.temperature > 0
        out = self.model.generate(
            **enc,
            do_sample=sampling,
            temperature=r.temperature if sampling else None,
            top_p=r.top_p if sampling else None,
            top_k=0 if sampling else None,  # vLLM applies no top-k by default; neither do we
            max_new_tokens=r.max_new_tokens,
            num_return_sequences=n,
            stop_strings=list(r.stop) or None,
            tokenizer=self.tokenizer if r.stop else None,
            pad_token_id=self.tokenizer.pad_token_id,
            output_scores=True,  # processed scores: log-probs of the distribution sampled from
            return_dict_in_generate=True,
        )
        width = enc["input_ids"].shape[1]
        gen = out.sequences[:, width:]
        # one step at a time: stacking [B*n, T, V] and its log-softmax held three copies of every
        # step's scores (37 GiB more for 256 × 256 tokens at a 152k vocabulary: OOM on an H200)
        logprobs = torch.stack([torch.log_softmax(step.float(), dim=-1).gather(-1, gen[:, t, None])[:, 0]
                                for t, step in enumerate(out.scores)], dim=1)
        samples = []
        for row in range(gen.shape[0]):
            p = row // n
            prompt_ids = enc["input_ids"][p][enc["attention_mask"][p].bool()].tolist()
            samples.append(
                self._finish(prompts[p], prompt_ids, gen[row].tolist(), logprobs[row].tolist())
            )
        return samples

    def generate(self, prompts: list[str], n: int) -> list[Sample]:
        return [s for chunk in self.generate_stream(prompts, n) for _i, s in chunk]

    def generate_stream(self, prompts: list[str], n: int) -> Iterator[list[tuple[int, Sample]]]:
        """``generate``'s samples, one ``generate`` call's worth at a time, with their indices."""
        per_call = max(1, self.chunk_size // n)
        for i in range(0, len(prompts), per_call):
            samples = self._generate_chunk(prompts[i : i + per_call], n)
            yield list(enumerate(samples, start=i * n))

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self.model.state_dict()
        for name, tensor in named_tensors:
            if name not in own:
                raise KeyError(f"policy weight {name!r} has no counterpart in the rollout model")
            own[name].copy_(tensor.detach())

    def sleep(self) -> None:
        """Nothing to free between calls on CPU (no cache outlives ``generate``)."""

    def wake(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """See ``sleep``."""

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
