"""The learner: policy (and reference, critic) on one device, and the update steps.

The proximal ("old") log-probs are the trained policy's own, taken from the first epoch's
forward pass; the sampler's log-probs kept with every sample are the behaviour policy, and the
truncated importance ratio between the two weights each token (stale samples, numeric mismatch).
Log-probs are computed at the sampling temperature. Sequences are
laid out as ``prompt + response`` right-padded to ``L``; per-token tensors are ``[B, L-1]`` in
next-token order, with ``mask`` marking the response tokens. Gradients are averaged across the
data-parallel group (``torch.distributed``) before clipping and the optimizer step, so every
controller holds the same weights after every step.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainer.algorithms import core as A
from trainer.config import TrainerConfig

__all__ = ["DataParallelGroup", "Learner", "RLBatch", "ValueModel", "lr_lambda"]


class DataParallelGroup:
    """The controllers' gradient all-reduce group: gloo on CPU, NCCL on GPU.

    Built directly on a TCPStore instead of torch.distributed's default group, because an
    in-process vLLM engine initializes (and expects to own) that default group for itself.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, world: int, *,
                 backend: str = "gloo", timeout_s: float = 600.0):
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world = rank, world
        self.store = dist.TCPStore(master_addr, master_port, world, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("yatt-dp", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum `t` over the group, in place."""
        self.pg.allreduce([t]).wait()
        return t

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def size(self) -> int:
        return self.world


@dataclass
class RLBatch:
    """What one RL update needs: token ids, and the scores of the `n` responses of each prompt."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    scores: list[float]
    n: int
    truncated: list[bool]
    # the sampler's log-prob of each response token (the behaviour policy); None: trust on-policy
    sample_logprobs: list[list[float]] | None = None
    # policy versions each sample lags the policy being trained (0: sampled by the current one)
    staleness: list[int] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)


class ValueModel(nn.Module):
    """PPO critic: the policy's backbone with a scalar head, one value per position."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.backbone = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        hidden = causal_lm.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.head(out.last_hidden_state.float()).squeeze(-1)


def lr_lambda(schedule: str, warmup: int, total: int):
    """Multiplier of the base lr at a step: linear warmup, then constant, linear or cosine decay."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        span = max(1, total - warmup)
        progress = min(1.0, (step - warmup) / span)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


# fp32 logits built at once by the log-prob pass: about 64 MiB, whatever the vocabulary
LOGITS_CHUNK_ELEMENTS = 16 * 2**20


def _scales_logits(model: nn.Module) -> bool:
    """Whether the model post-processes its LM head's output (then the full forward is used)."""
    c = getattr(model, "config", None)
    return bool(getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None))


def _adamw(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW with the fused kernel (CPU and CUDA; measured 8x faster than the default on CPU)."""
    return torch.optim.AdamW(params, fused=True, **kwargs)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class Learner:
    def __init__(self, cfg: TrainerConfig, model_dir: str | Path, *, device: str = "cpu",
                 dist_group: Any = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.device = torch.device(device)
        self.group = dist_group  # None: a data-parallel group of one
        algo = cfg.algorithm
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir),
                                                       trust_remote_code=cfg.model.trust_remote_code)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.policy = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=_dtype(cfg.model.dtype),
            trust_remote_code=cfg.model.trust_remote_code).to(self.device)
        self.policy.train()
        self.reference: nn.Module | None = None
        if algo.kl_coef > 0 and algo.name != "sft":
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.critic: ValueModel | None = None
        self.critic_opt: torch.optim.Optimizer | None = None
        if algo.name == "ppo":
            self.critic = ValueModel(copy.deepcopy(self.policy)).to(self.device)
            self.critic_opt = _adamw(self.critic.parameters(), lr=algo.critic_lr)
        self.optimizer = _adamw(self.policy.parameters(), lr=cfg.train.lr,
                                weight_decay=cfg.train.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.train.lr_schedule, cfg.train.warmup_steps,
                                      cfg.train.max_steps))

    # ------------------------------------------------------------------ batches and forwards
    def _layout(self, prompt_ids: list[list[int]], response_ids: list[list[int]]
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Right-padded ``prompt + response`` sequences and where their responses sit.

        Returns ``input_ids [B, L]``, ``attention_mask [B, L]``, ``index [B, T]`` (the position in
        next-token order that predicts each response token) and ``mask [B, T]``. Per-token
        tensors handed to trainer.algorithms are response-aligned ``[B, T]``: token 0 is the
        first response token of every row, as those functions expect.
        """
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
        L = max(lengths)
        T = max(len(r) for r in response_ids)
        B = len(lengths)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        index = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            seq = list(p) + list(r)
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attn[i, : len(seq)] = 1
            index[i, : len(r)] = torch.arange(len(p) - 1, len(seq) - 1)
            mask[i, : len(r)] = 1.0
        return ids.to(self.device), attn.to(self.device), index.to(self.device), mask.to(self.device)

    def _logprobs(self, model: nn.Module, ids: Tensor, attn: Tensor, index: Tensor, *,
                  entropy: bool = False, temperature: float = 1.0, response_only: bool = True
                  ) -> tuple[Tensor, Tensor | None]:
        """Response-aligned log-probs ``[B, T]`` (and entropies) of ``model`` on the batch.

        ``temperature`` divides the logits, so the log-probs are those of the distribution the
        sampler drew from. Logits are built only at the response positions and a few positions
        at a time (never a full fp32 ``[B, L, V]``): the LM head runs on gathered hidden states.
        """
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not response_only or head is None or not hasattr(model, "get_decoder") or _scales_logits(model):
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
            if temperature > 0 and temperature != 1.0:
                logits = logits / temperature
            lp = A.token_logprobs(logits, ids[:, 1:]).gather(1, index)
            ent = A.entropy_from_logits(logits).gather(1, index) if entropy else None
            return lp, ent
        # no KV cache: a training forward never decodes further
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        h = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, T, H]
        targets = ids.gather(1, index + 1)
        rows, length = targets.shape
        vocab = int(head.weight.shape[0])
        step = max(1, LOGITS_CHUNK_ELEMENTS // max(1, rows * vocab))  # positions per chunk
        lps, ents = [], []
        for t in range(0, length, step):
            logits = head(h[:, t : t + step]).float()
            if temperature > 0 and temperature != 1.0:
                logits = logits / temperature
            lse = torch.logsumexp(logits, dim=-1)
            lps.append(logits.gather(-1, targets[:, t : t + step, None]).squeeze(-1) - lse)
            if entropy:
                ents.append(lse - (torch.softmax(logits, dim=-1) * logits).sum(-1))
        return torch.cat(lps, dim=1), (torch.cat(ents, dim=1) if entropy else None)

    def _values(self, ids: Tensor, attn: Tensor, index: Tensor) -> Tensor:
        assert self.critic is not None
        return self.critic(ids, attn)[:, :-1].gather(1, index)

    # ------------------------------------------------------------------ distributed
    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def _all_reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Average gradients over the group in place, one collective per tensor, all in flight
        at once (no flat copy of every gradient: measured 0.3 s per step for 17M parameters)."""
        if self.group is None:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        works = [self.group.pg.allreduce([p.grad]) for p in params]
        for w in works:
            w.wait()
        for p in params:
            assert p.grad is not None
            p.grad.div_(self.world_size)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64 if self.device.type == "cpu" else torch.float32,
                         device=self.device)
        if self.group is not None:
            self.group.all_reduce(t)
        return t.cpu().tolist()

    # ------------------------------------------------------------------ SFT
    def sft_step(self, prompts: list[str], targets: list[str], optimizer: torch.optim.Optimizer
                 ) -> dict[str, float]:
        """One supervised step on prompt → target + EOS; returns loss/sft and grad_norm."""
        tok = self.tokenizer
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        r_ids = [tok(t, add_special_tokens=False)["input_ids"] + [self.eos_id] for t in targets]
        ids, attn, index, mask = self._layout(p_ids, r_ids)
        optimizer.zero_grad(set_to_none=True)
        # the full forward, as before: the SFT warm start keeps its numerics (its accuracy jump
        # after a fixed number of steps is sensitive to them; see bench/learn_check.py)
        lp, _ = self._logprobs(self.policy, ids, attn, index, response_only=False)
        loss = -A.masked_mean(lp, mask)  # token-mean cross entropy on the completion
        loss.backward()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self._all_reduce_grads(params)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)
        optimizer.step()
        return {"loss/sft": float(loss.detach()), "grad_norm": float(grad_norm),
                "trained_tokens": float(mask.sum())}

    # ------------------------------------------------------------------ RL
    def rl_step(self, batch: RLBatch, recorder: Any = None) -> dict[str, float]:
        """One policy update (`train.ppo_epochs` optimizer steps) on a batch of scored samples.

        Off-policy correct: the proximal ("old") log-probs are the policy's own, taken from the
        first epoch's forward pass (no separate recompute pass), and the sampler's log-probs are
        the behaviour policy: each token's loss is weighted by the truncated importance ratio
        ``min(pi_old / pi_sampler, algorithm.tis_cap)``, which corrects both stale samples
        (disaggregated) and sampler/trainer numeric mismatch. Every rank runs the same
        collectives in the same order, an empty batch included (zero gradients, same clipping,
        same critic step), so all ranks hold identical weights after every step.
        """
        cfg, algo = self.cfg, self.cfg.algorithm
        temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        metrics: dict[str, float] = {}
        params = [p for p in self.policy.parameters() if p.requires_grad]
        rows = len(batch)
        returns: Tensor | None = None
        adv_tok: Tensor | None = None
        if rows:
            ids, attn, index, mask = self._layout(batch.prompt_ids, batch.response_ids)
            scores = torch.tensor(batch.scores, dtype=torch.float32, device=self.device)
            if algo.overlong_penalty > 0:
                lengths = mask.sum(dim=1)
                buffer = max(1, cfg.rollout.max_new_tokens // 4)
                scores = scores + algo.overlong_penalty * A.overlong_penalty(
                    lengths, cfg.rollout.max_new_tokens, buffer).to(scores.device)
            mb = cfg.train.micro_batch_size
            chunks = [slice(i, min(i + mb, rows)) for i in range(0, rows, mb)]
            behaviour, has_behaviour = self._behaviour_logprobs(batch, mask)

            ref_span = recorder.span("reference") if recorder is not None else contextlib.nullcontext()
            with torch.no_grad(), ref_span:
                old_lp = None
                if algo.kl_in_reward and self.reference is not None:
                    # the KL shapes the reward, so the policy's log-probs are needed up front
                    self.policy.eval()
                    old_lp = torch.cat([self._logprobs(self.policy, ids[c], attn[c], index[c],
                                                       temperature=temp)[0] for c in chunks])
                    self.policy.train()
                ref_lp = kl_r = None
                if self.reference is not None:
                    ref_lp = torch.cat([self._logprobs(self.reference, ids[c], attn[c], index[c],
                                                       temperature=temp)[0] for c in chunks])
                    if old_lp is not None:
                        kl_r = A.kl_penalty(old_lp, ref_lp, algo.kl_estimator) * mask
                values = None
                if self.critic is not None:
                    values = torch.cat([self._values(ids[c], attn[c], index[c]) for c in chunks]) * mask

                if algo.name in ("grpo", "rloo"):
                    seq_scores = scores - (algo.kl_coef * kl_r.sum(dim=1) if kl_r is not None else 0.0)
                    if algo.name == "grpo":
                        adv = A.grpo_advantages(seq_scores, batch.n, algo.norm_adv_by_std)
                    else:
                        adv = A.rloo_advantages(seq_scores, batch.n)
                    adv_tok = adv.unsqueeze(1).expand_as(mask) * mask
                elif algo.name == "reinforce_pp":
                    adv_tok = A.discounted_returns(A.token_rewards(scores, mask, kl_r, algo.kl_coef),
                                                   mask, algo.gamma)
                elif algo.name == "ppo":
                    assert values is not None
                    tok_r = A.token_rewards(scores, mask, kl_r, algo.kl_coef)
                    adv_tok, returns = A.gae_advantages(tok_r, values, mask, algo.gamma, algo.lam)
                    metrics["critic/value_mean"] = float(A.masked_mean(values, mask))
                else:
                    raise ValueError(f"algorithm {algo.name!r} is not an RL algorithm")
            local = [float(mask.sum()), float(rows), float((adv_tok * mask).sum()),
                     float((adv_tok.double() ** 2 * mask).sum())]
        else:
            if algo.name not in ("grpo", "rloo", "reinforce_pp", "ppo"):
                raise ValueError(f"algorithm {algo.name!r} is not an RL algorithm")
            local = [0.0, 0.0, 0.0, 0.0]
        # One collective on every rank: the global batch's size and its advantage moments.
        g_tokens, g_rows, adv_sum, adv_sq = self.all_reduce_sum(local)
        if rows and adv_tok is not None and algo.name in ("ppo", "reinforce_pp"):
            # whitened over the whole data-parallel batch, not per rank
            mean = adv_sum / max(g_tokens, 1.0)
            var = max(adv_sq - g_tokens * mean * mean, 0.0) / max(g_tokens - 1.0, 1.0)
            adv_tok = (adv_tok - mean) / (math.sqrt(var) + 1e-8) * mask
        if rows:
            assert adv_tok is not None
            metrics["advantage/mean"] = float(A.masked_mean(adv_tok, mask))
            metrics["advantage/abs_mean"] = float(A.masked_mean(adv_tok.abs(), mask))

        world = self.world_size
        want_entropy_grad = algo.entropy_coef > 0
        sums = {"loss/policy": 0.0, "loss/kl": 0.0, "loss/value": 0.0, "entropy": 0.0,
                "clip_frac": 0.0, "loss/total": 0.0, "kl/mean": 0.0}
        off = {"diff": 0.0, "weight": 0.0, "capped": 0.0, "tokens": 0.0}
        old_chunks: list[Tensor] = []
        grad_norms: list[float] = []
        for epoch in range(cfg.train.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_opt is not None:
                self.critic_opt.zero_grad(set_to_none=True)
            for k, c in enumerate(chunks if rows else []):
                m = mask[c]
                # this chunk's share of the global batch's loss (gradients are averaged over ranks)
                if algo.loss_agg == "token_mean":
                    w = float(m.sum()) / max(g_tokens, 1.0) * world
                    mw = float(m.sum()) / max(float(mask.sum()), 1.0)
                else:
                    w = (c.stop - c.start) / max(g_rows, 1.0) * world
                    mw = (c.stop - c.start) / rows
                lp, ent = self._logprobs(self.policy, ids[c], attn[c], index[c], entropy=True,
                                         temperature=temp)
                assert ent is not None
                if epoch == 0:
                    # before any update the policy is the proximal policy: its log-probs are "old"
                    old_chunks.append(old_lp[c] if old_lp is not None else lp.detach())
                old_c = old_chunks[k]
                log_w = (old_c - behaviour[c]) * has_behaviour[c]
                is_w = torch.exp(log_w)
                if algo.tis_cap > 0:
                    is_w = is_w.clamp(max=algo.tis_cap)
                if epoch == 0:
                    hm = m * has_behaviour[c]
                    off["diff"] += float((log_w.abs() * hm).sum())
                    off["weight"] += float((is_w * hm).sum())
                    off["capped"] += float(((torch.exp(log_w) > algo.tis_cap) * hm).sum()) if algo.tis_cap > 0 else 0.0
                    off["tokens"] += float(hm.sum())
                pl, cf = A.policy_loss(lp, old_c, adv_tok[c], m, algo.clip_ratio_low,
                                       algo.clip_ratio_high, algo.loss_agg, is_weights=is_w)
                loss = pl
                if ref_lp is not None:
                    kl_tok = A.kl_penalty(lp, ref_lp[c], algo.kl_estimator)
                    kl_t = A.aggregate(kl_tok, m, algo.loss_agg)
                    sums["kl/mean"] += mw * float(A.masked_mean(kl_tok.detach(), m))
                    if not algo.kl_in_reward:
                        loss = loss + algo.kl_coef * kl_t
                        sums["loss/kl"] += mw * float(kl_t.detach())
                ent_agg = A.aggregate(ent if want_entropy_grad else ent.detach(), m, algo.loss_agg)
                if want_entropy_grad:
                    loss = loss - algo.entropy_coef * ent_agg
                (loss * w).backward()
                sums["loss/policy"] += mw * float(pl.detach())
                sums["entropy"] += mw * float(ent_agg.detach())
                sums["clip_frac"] += mw * float(cf)
                sums["loss/total"] += mw * float(loss.detach())
                if self.critic is not None:
                    assert values is not None and returns is not None
                    v = self._values(ids[c], attn[c], index[c])
                    vl, _ = A.value_loss(v, values[c], returns[c], m)
                    (vl * w).backward()
                    sums["loss/value"] += mw * float(vl.detach())
            grad_norms.append(self._apply_gradients(params, self.optimizer))
            if self.critic is not None:
                assert self.critic_opt is not None
                self._apply_gradients(list(self.critic.parameters()), self.critic_opt)
        self.scheduler.step()
        lr = self.scheduler.get_last_lr()[0]
        if not rows:
            return {"train/empty_batch": 1.0, "lr": lr, "grad_norm": sum(grad_norms) / len(grad_norms)}
        epochs = cfg.train.ppo_epochs
        metrics.update({k: v / epochs for k, v in sums.items()})
        if self.reference is None:
            metrics.pop("kl/mean")
        if self.reference is None or algo.kl_in_reward:
            metrics.pop("loss/kl")
        if self.critic is None:
            metrics.pop("loss/value")
        if off["tokens"]:
            metrics["rollout/logprob_diff"] = off["diff"] / off["tokens"]
            metrics["rollout/is_weight_mean"] = off["weight"] / off["tokens"]
            metrics["rollout/is_capped_frac"] = off["capped"] / off["tokens"]
        if batch.staleness is not None:
            metrics["rollout/stale_frac"] = sum(s > 0 for s in batch.staleness) / rows
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["lr"] = lr
        metrics["trained_tokens"] = float(mask.sum())
        return metrics

    def _behaviour_logprobs(self, batch: RLBatch, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The sampler's log-probs ``[B, T]`` and a row mask of the samples that carry them."""
        rows, length = mask.shape
        out = torch.zeros((rows, length), dtype=torch.float32)
        has = torch.zeros((rows, 1), dtype=torch.float32)
        for i, (lps, resp) in enumerate(zip(batch.sample_logprobs or [[]] * rows,
                                            batch.response_ids, strict=True)):
            if lps and len(lps) == len(resp):
                out[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
                has[i] = 1.0
        return out.to(self.device), has.to(self.device)

    def _apply_gradients(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> float:
        """All-reduce, clip and step: the same on every rank, with or without local gradients."""
        self._all_reduce_grads(params)
        for p in params:
            if p.grad is None:  # a rank with nothing to train still steps on the averaged grads
                p.grad = torch.zeros_like(p)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip))
        optimizer.step()
        return norm

    # ------------------------------------------------------------------ eval and weights
    @torch.no_grad()
    def greedy(self, prompts: list[str], max_new_tokens: int, batch_size: int = 128) -> list[str]:
        """Greedy completions of `prompts` with the policy (held-out evaluation)."""
        self.policy.eval()
        out: list[str] = []
        try:
            for i in range(0, len(prompts), batch_size):
                enc = self.tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True,
                                     add_special_tokens=False).to(self.device)
                gen = self.policy.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                           pad_token_id=self.pad_id, eos_token_id=self.eos_id)
                new = gen[:, enc["input_ids"].shape[1]:]
                out.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
        finally:
            self.policy.train()
        return out

    def named_weights(self) -> dict[str, Tensor]:
        """The policy's weights by HF name, where they live (no copy): what a sampler loads after
        an update, in place or through trainer.weight_sync's broadcast."""
        return {k: v.detach() for k, v in self.policy.state_dict().items()}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.policy.parameters())
