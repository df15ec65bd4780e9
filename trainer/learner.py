"""The learner: policy (and reference, critic) on one device, and the update steps.

The proximal ("old") log-probs are the trained policy's own, taken from the first epoch's
forward pass; the sampler's log-probs kept with every sample are the behaviour policy, and the
truncated importance ratio between the two weights each token (stale samples, numeric mismatch).
Log-probs are computed at the sampling temperature. Sequences are
laid out as ``prompt + response`` right-padded to ``L``; per-token tensors are ``[B, L-1]`` in
next-token order, with ``mask`` marking the response tokens. Gradients are averaged across the
data-parallel group (``torch.distributed``) before clipping and the optimizer step, so every
controller holds the same weights after every step. Ranks on one host (gloo) keep their
gradients in shared memory and average them there after the backward (trainer/shm_grads.py);
otherwise the all-reduce runs during the step's last backward, bucket by bucket as DDP does
(`GradientBuckets`).

With ``train.strategy: fsdp2`` the policy, reference and critic are sharded over the same group
instead (``fully_shard`` block by block, then the root: `apply_fsdp`); every forward and
backward is then a collective, so every rank runs the same number of them, padding with a
masked-out micro-batch where it has fewer rows (`_idle_passes`).

FSDP2 on CPU (torch 2.13, gloo), as read in its sources and checked by
tests/integration/test_learner_fsdp.py: its all-gather (``all_gather_single``) and
reduce-scatter (``reduce_scatter_single``, ``ReduceOp.AVG`` for fp32/bf16 gradients) run on
gloo, bf16 mixed precision too, and fp32 results equal the unsharded learner's;
``CPUOffloadPolicy`` must not pin memory without an accelerator. Its ``DeviceMesh`` needs a
registered process group and this process's rank, not the default group's (`device_mesh`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from trainer.algorithms import core as A
from trainer.config import TrainerConfig
from trainer.precision import cpu_native_bf16
from trainer.shm_grads import SharedGradients

__all__ = ["DataParallelGroup", "FrozenReference", "Learner", "RLBatch", "ResponseLogprobs", "ValueModel",
           "apply_fsdp", "chunk_logprobs", "response_layout",
           "lr_lambda"]


log = logging.getLogger(__name__)


class DataParallelGroup:
    """The controllers' gradient all-reduce group: gloo on CPU, NCCL on GPU.

    Built directly on a TCPStore instead of torch.distributed's default group, because an
    in-process vLLM engine initializes (and expects to own) that default group for itself.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, world: int, *,
                 backend: str = "gloo", timeout_s: float = 600.0):
        from datetime import timedelta

        from torch.distributed import distributed_c10d as c10d

        from trainer import rendezvous

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world, self.backend, self.timeout_s = rank, world, backend, timeout_s
        self.store = rendezvous.store(master_addr, master_port, rank, world, timeout_s=timeout_s)
        # A registered ProcessGroup (not a bare gloo/NCCL backend): FSDP2 and DTensor look their
        # group up by name. Made like torch's own init_process_group makes one, minus the default.
        # The name prefixes the backend's keys in the store, so every rank must use the same one,
        # and it must be new in each rank's process: rank 0 draws it and publishes it (a count
        # of the groups each process made diverges as soon as one rank's process made another)
        if rank == 0:
            self.store.set("yatt-dp/name", f"yatt-dp-{uuid.uuid4().hex[:16]}")
        name = self.store.get("yatt-dp/name").decode()
        self.pg, _ = c10d._new_process_group_helper(world, rank, [], backend, self.store,
                                                    group_name=name, timeout=timeout)
        c10d._world.pg_group_ranks[self.pg] = {r: r for r in range(world)}
        self._keys = itertools.count()  # store keys of what the ranks set up together, in order

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """Reduce `t` over the group in place: ``op`` is "sum" or "max"."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self.pg.allreduce([t], opts).wait()
        return t

    def device_mesh(self, device_type: str) -> Any:
        """A one-dimensional DeviceMesh over this group, for FSDP2.

        Built with this process's rank given explicitly: the default process group, if any, is
        an in-process vLLM engine's world of one, whose rank (0 everywhere) is not ours.
        """
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(device_type, torch.arange(self.world), _init_backend=False, _rank=self.rank)
        mesh._dim_group_names = [self.pg.group_name]
        mesh._pg_registry[self.pg.group_name] = self.pg
        return mesh

    def key(self, name: str) -> str:
        """A store key for the next thing every rank sets up together (the same on every rank,
        as long as they set things up in the same order)."""
        return f"{name}/{next(self._keys)}"

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def size(self) -> int:
        return self.world


# DDP's default bucket size (bucket_cap_mb=25): the gradients launched together mid-backward
GRAD_BUCKET_BYTES = 25 * 2**20
# False: every gradient all-reduced after the whole backward (the tests compare the two ways)
OVERLAP_GRAD_ALL_REDUCE = True
# False: ranks on one host average gradients over gloo too (trainer/shm_grads.py; the tests
# compare the ways); YATT_SHM_GRADS=0 does the same for a run
SHARED_MEMORY_GRADS = True
# compiled variants of one transformer block's forward that `train.compile` allows (see Learner)
COMPILE_VARIANTS = 32


class GradientBuckets:
    """Averages a module's gradients over the data-parallel group while its backward runs, as DDP.

    Parameters fall into buckets of about `GRAD_BUCKET_BYTES` in reverse registration order (about
    the order backward finishes them). Once `arm` is called, the next backward launches bucket k
    as soon as its last gradient is accumulated and buckets 0..k-1 are launched: every rank
    launches the same collectives in the same order, as gloo needs. `flush` launches the rest in
    that order (parameters without a gradient, a rank with nothing to train: zeros); `wait` ends
    them and divides by the world size. Within a bucket one all-reduce per tensor, all in flight:
    with gloo on CPU, flattening each bucket into one buffer measured 1.5x slower (the copies).
    """

    def __init__(self, params: list[nn.Parameter], group: DataParallelGroup,
                 bucket_bytes: int | None = None):
        self.params, self.group = params, group
        bucket_bytes = bucket_bytes or GRAD_BUCKET_BYTES
        self.buckets: list[list[int]] = [[]]
        size = 0
        for i in reversed(range(len(params))):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += params[i].numel() * params[i].element_size()
        self.bucket_of = {i: k for k, bucket in enumerate(self.buckets) for i in bucket}
        self.missing = [len(b) for b in self.buckets]  # gradients each bucket still waits for
        self.launched = 0  # buckets 0..launched-1 are in flight
        self.works: list[Any] = []
        self.armed = False
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))

    def arm(self) -> None:
        """The next backward is the last before the optimizer step: launch buckets as they fill."""
        self.missing = [len(b) for b in self.buckets]
        self.launched, self.works, self.armed = 0, [], True

    def _accumulated(self, i: int, _: Tensor) -> None:
        if not self.armed:  # an earlier micro-batch: its gradients still accumulate
            return
        k = self.bucket_of[i]
        if k < self.launched:  # a second accumulation into a gradient already on the wire
            raise RuntimeError("a gradient was accumulated twice in one backward")
        self.missing[k] -= 1
        while self.launched < len(self.buckets) and self.missing[self.launched] == 0:
            self._launch()

    def _launch(self) -> None:
        for i in self.buckets[self.launched]:
            p = self.params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.works.append(self.group.pg.allreduce([p.grad]))
        self.launched += 1

    def flush(self) -> None:
        """Launch, in order, the buckets the backward left (call it on every rank)."""
        self.armed = False
        while self.launched < len(self.buckets):
            self._launch()

    def wait(self) -> None:
        """End every launched all-reduce and turn the sums into averages."""
        self.flush()
        for w in self.works:
            w.wait()
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_div_(grads, self.group.size())
        self.launched, self.works = 0, []


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
    # the frozen reference's log-prob of each response token, where a rollout worker computed it
    # after generating (`placement.reference_on_rollout`); None or [] for a row: the learner's pass
    ref_logprobs: list[list[float]] | None = None

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
        # the head's dtype: float32, or bfloat16 while FSDP2 mixed precision has it gathered
        return self.head(out.last_hidden_state.to(self.head.weight.dtype)).float().squeeze(-1)


class ResponseLogprobs(nn.Module):
    """A causal LM's forward as the trainer runs it: log-probs of the response tokens only.

    One module, so that under FSDP2 it is the root whose forward gathers the parameters
    outside the transformer blocks (embeddings, final norm, LM head) and reduces their
    gradients; the policy itself stays the plain HF model (its names, `generate`, saving).
    """

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.lm = causal_lm

    def forward(self, ids: Tensor, attn: Tensor, index: Tensor, *, entropy: bool = False,
                entropy_grad: bool = True, temperature: float = 1.0, response_only: bool = True
                ) -> tuple[Tensor, Tensor | None]:
        """``temperature`` divides the logits, so the log-probs are those of the distribution the
        sampler drew from. Logits are built only at the response positions and a few positions
        at a time (never a full fp32 ``[B, L, V]``): the LM head runs on gathered hidden states.
        With ``entropy_grad=False`` the entropy is a reported figure only: computed outside
        autograd, so its softmax is not kept for the backward (one ``[B, T, V]`` fp32 less).
        """
        def ent_of(logits: Tensor, lse: Tensor | None = None) -> Tensor:
            # under no_grad nothing here is recorded for the backward; `lse` is the chunk's own
            with contextlib.nullcontext() if entropy_grad else torch.no_grad():
                if lse is None:
                    return A.entropy_from_logits(logits)
                return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)

        model = self.lm
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not response_only or head is None or not hasattr(model, "get_decoder") or _scales_logits(model):
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
            if temperature > 0 and temperature != 1.0:
                logits = logits / temperature
            lp = A.token_logprobs(logits, ids[:, 1:]).gather(1, index)
            ent = ent_of(logits).gather(1, index) if entropy else None
            return lp, ent
        # no KV cache: a training forward never decodes further
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        h = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, T, H]
        targets = ids.gather(1, index + 1)
        rows, length = targets.shape
        vocab = int(head.weight.shape[0])
        budget = LOGITS_CHUNK_ELEMENTS * (LOGITS_CHUNK_GPU_FACTOR if h.is_cuda else 1)
        step = max(1, budget // max(1, rows * vocab))  # positions per chunk
        lps, ents = [], []
        for t in range(0, length, step):
            logits = head(h[:, t : t + step]).float()
            if temperature > 0 and temperature != 1.0:
                logits = logits / temperature
            lse = torch.logsumexp(logits, dim=-1)
            lps.append(logits.gather(-1, targets[:, t : t + step, None]).squeeze(-1) - lse)
            if entropy:
                ents.append(ent_of(logits, lse))
        return torch.cat(lps, dim=1), (torch.cat(ents, dim=1) if entropy else None)


AUTO_MULTIPLE = 16


def padded_length(n: int, multiple: int | str, cap: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (`train.pad_to_multiple`), at most ``cap``.

    ``"auto"``: a multiple of 16, or of the largest power of two no more than ``n / 16`` where
    that is smaller, so the padding stays within a sixteenth of ``n`` (38 stays 38, 103 → 104,
    200 → 200, 270 → 272).
    """
    if multiple == "auto":
        multiple = min(AUTO_MULTIPLE, 1 << max(0, (n // 16).bit_length() - 1))
    assert isinstance(multiple, int)
    n = -(-n // multiple) * multiple
    return n if cap is None else min(n, cap)


def response_layout(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
                    device: torch.device | str = "cpu", multiple: int | str = 1
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded ``prompt + response`` sequences and where their responses sit.

    Returns ``input_ids [B, L]``, ``attention_mask [B, L]``, ``index [B, T]`` (the position in
    next-token order that predicts each response token) and ``mask [B, T]``. Per-token
    tensors handed to trainer.algorithms are response-aligned ``[B, T]``: token 0 is the
    first response token of every row, as those functions expect. ``L`` is the longest
    sequence rounded up to ``multiple`` (`train.pad_to_multiple`), so that the micro-batches cut
    from it (`_trimmed`) come in a few lengths only.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    L = padded_length(max(lengths), multiple)
    T = max(len(r) for r in response_ids)
    B = len(lengths)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    index = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        seq = list(p) + list(r)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        index[i, : len(r)] = torch.arange(len(p) - 1, len(seq) - 1)
        mask[i, : len(r)] = 1.0
    return ids.to(device), attn.to(device), index.to(device), mask.to(device)


def chunk_logprobs(run: ResponseLogprobs, ids: Tensor, attn: Tensor, index: Tensor, mask: Tensor,
                   rows: Tensor, *, multiple: int | str = 1, min_rows: int = 1, **kwargs: Any
                   ) -> tuple[Tensor, Tensor | None]:
    """``run``'s log-probs (and entropies) of the batch rows `rows`, cut to their own longest
    sequence (rounded up to ``multiple``) and response (right padding: nothing a kept token
    attends to is cut), padded back to the batch's ``[len(rows), T]`` with zeros where the mask
    is zero. Fewer rows than ``min_rows`` run with copies of the last one (`_rows_floor`),
    whose outputs are dropped."""
    (c_ids, c_attn, c_index), pad = _trimmed(ids, attn, index, mask, rows, multiple)
    n = c_ids.shape[0]
    lp, ent = run(*_with_copies((c_ids, c_attn, c_index), min_rows), **kwargs)
    lp, ent = lp[:n], (ent[:n] if ent is not None else None)
    return F.pad(lp, (0, pad)), (F.pad(ent, (0, pad)) if ent is not None else None)


def _with_copies(tensors: tuple[Tensor, ...], min_rows: int) -> tuple[Tensor, ...]:
    """The row-aligned ``tensors`` with their last row repeated up to ``min_rows`` rows."""
    n = tensors[0].shape[0]
    if n == 0 or n >= min_rows:
        return tensors
    return tuple(torch.cat([t, t[-1:].expand(min_rows - n, *t.shape[1:])]) for t in tensors)


def micro_batches(lengths: Tensor, max_rows: int, max_tokens: int | None = None, multiple: int | str = 1
                  ) -> list[Tensor]:
    """The rows of a batch (their sequence lengths) as micro-batches: row indices, longest rows
    first, each micro-batch at most `max_rows` rows and, when `max_tokens` is set, at most that
    many padded tokens (rows × its longest row rounded up to ``multiple``, as `_trimmed` cuts it;
    a row longer than that goes alone). Sorted by length, a micro-batch of short responses is
    padded to its own longest, not the batch's.

    A last micro-batch of one row takes a row from the one before when that has three or more
    (both caps still hold: two rows no longer than that one's shortest): under `train.compile`
    a one-row batch is a shape of its own to dynamo (it specializes sizes 0 and 1), and meeting
    one mid-run recompiled every block variant, 20 s of a 6 s step on the `small` model."""
    order = torch.argsort(lengths.cpu(), descending=True, stable=True).tolist()
    sizes = [padded_length(n, multiple) for n in lengths.cpu().tolist()]
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if (cur is None or len(cur) >= max_rows
                or (max_tokens is not None and (len(cur) + 1) * sizes[cur[0]] > max_tokens)):
            out.append([i])
        else:
            cur.append(i)
    if len(out) > 1 and len(out[-1]) == 1 and len(out[-2]) >= 3:
        out[-1].insert(0, out[-2].pop())
    return [torch.tensor(c, dtype=torch.long, device=lengths.device) for c in out]


def deal_groups(costs: list[int], world: int) -> list[int]:
    """The rank each group goes to: longest first, each to the rank with the least so far (ties:
    the lower group index first, the lower rank). The same on every rank, given the same costs."""
    loads = [0] * world
    owner = [0] * len(costs)
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owner[g] = r
        loads[r] += costs[g]
    return owner


def _encode_rows(batch: RLBatch) -> tuple[list[int], list[float]]:
    """A batch's rows as flat integers (lengths, staleness, truncation, token ids) and floats
    (score, sampler log-probs, reference log-probs), for `Learner._balanced`'s exchange."""
    ints: list[int] = []
    floats: list[float] = []
    for i in range(len(batch)):
        lps = batch.sample_logprobs[i] if batch.sample_logprobs is not None else []
        refs = (batch.ref_logprobs[i] or []) if batch.ref_logprobs is not None else []
        stale = batch.staleness[i] if batch.staleness is not None else -1
        p, r = batch.prompt_ids[i], batch.response_ids[i]
        ints += [len(p), len(r), len(lps), len(refs), stale, int(batch.truncated[i]), *p, *r]
        floats += [batch.scores[i], *lps, *refs]
    return ints, floats


def _decode_rows(ints: list[int], floats: list[float], rows: int) -> list[tuple]:
    """`_encode_rows` back: (prompt, response, score, truncated, logprobs, staleness,
    reference log-probs) per row."""
    out, i, f = [], 0, 0
    for _ in range(rows):
        plen, rlen, llen, rflen, stale, trunc = ints[i: i + 6]
        i += 6
        p, r = ints[i: i + plen], ints[i + plen: i + plen + rlen]
        i += plen + rlen
        lps = floats[f + 1: f + 1 + llen]
        refs = floats[f + 1 + llen: f + 1 + llen + rflen]
        out.append((p, r, floats[f], bool(trunc), lps, stale, refs))
        f += 1 + llen + rflen
    return out


def _batch_of_rows(rows: list[tuple], n: int) -> RLBatch:
    """An `RLBatch` of `_decode_rows`' rows."""
    stale = [row[5] for row in rows]
    return RLBatch(prompt_ids=[row[0] for row in rows], response_ids=[row[1] for row in rows],
                   scores=[row[2] for row in rows], n=n, truncated=[row[3] for row in rows],
                   sample_logprobs=[row[4] for row in rows],
                   staleness=None if all(s < 0 for s in stale) else [max(s, 0) for s in stale],
                   ref_logprobs=[row[6] for row in rows] if any(row[6] for row in rows) else None)


def _pack_rows(batch: RLBatch) -> bytes:
    """A batch as bytes for the store (`Learner._queued_rl_step`): rows, n, then `_encode_rows`."""
    ints, floats = _encode_rows(batch)
    head = np.array([len(batch), batch.n, len(ints), len(floats)], dtype=np.int64)
    return (head.tobytes() + np.asarray(ints, dtype=np.int64).tobytes()
            + np.asarray(floats, dtype=np.float64).tobytes())


def _unpack_rows(payload: bytes) -> RLBatch:
    rows, n, n_ints, n_floats = np.frombuffer(payload[:32], dtype=np.int64).tolist()
    ints = np.frombuffer(payload[32: 32 + 8 * n_ints], dtype=np.int64).tolist()
    floats = np.frombuffer(payload[32 + 8 * n_ints: 32 + 8 * (n_ints + n_floats)], dtype=np.float64).tolist()
    return _batch_of_rows(_decode_rows(ints, floats, rows), n)


@dataclass
class _Share:
    """One rank's rows laid out for training, the same on every rank that takes a micro-batch of
    them (`Learner._queued_rl_step`)."""

    batch: RLBatch
    chunks: list[Tensor]
    ids: Tensor | None = None
    attn: Tensor | None = None
    index: Tensor | None = None
    mask: Tensor | None = None
    adv: Tensor | None = None  # [B, T] token advantages
    behaviour: Tensor | None = None
    has_behaviour: Tensor | None = None
    ref_lp: Tensor | None = None  # [B, T]: given with the rows, or filled in as micro-batches pass
    ref_todo: Tensor | None = None  # [B] bool: rows whose reference log-probs did not come with them
    # passed before the advantages (`Learner._queued_passes`)
    here: Tensor | None = None  # [B] bool: rows whose passes this rank ran
    old_lp: Tensor | None = None  # [B, T]: the proximal policy's, for a KL in the reward
    values: Tensor | None = None  # [B, T]: the critic's
    returns: Tensor | None = None  # [B, T]: the critic's targets


def _moments(adv: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """Tokens, sum and sum of squares of token advantages (for whitening over several ranks'
    or shares' rows)."""
    return (float(mask.sum()), float((adv * mask).sum()), float((adv.double() ** 2 * mask).sum()))


def _whitened(adv: Tensor, mask: Tensor, tokens: float, total: float, square: float) -> Tensor:
    """Token advantages whitened by the moments of the whole batch (`_moments`, summed)."""
    mean = total / max(tokens, 1.0)
    var = max(square - tokens * mean * mean, 0.0) / max(tokens - 1.0, 1.0)
    return (adv - mean) / (math.sqrt(var) + 1e-8) * mask


def in_row_order(chunks: list[Tensor], parts: list[Tensor]) -> Tensor:
    """Per-chunk results (rows in `chunks` order) back in the batch's row order."""
    rows = torch.cat(chunks)
    return torch.cat(parts)[torch.argsort(rows)]


def _trimmed(ids: Tensor, attn: Tensor, index: Tensor, mask: Tensor, rows: Tensor, multiple: int | str = 1
             ) -> tuple[tuple[Tensor, Tensor, Tensor], int]:
    """The rows' inputs cut to their longest sequence (rounded up to ``multiple``, within the
    layout's width) and response, and the response columns cut."""
    c_attn = attn[rows]
    length = padded_length(int(c_attn.sum(dim=1).max()), multiple, attn.shape[1])
    t_len = max(int(mask[rows].sum(dim=1).max()), min(1, index.shape[1]))
    return (ids[rows][:, :length], c_attn[:, :length], index[rows][:, :t_len]), index.shape[1] - t_len


def _transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF causal LM or of its decoder (Llama/Qwen ``layers``, GPT-2 ``h``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for attr in ("layers", "h", "blocks"):
        blocks = getattr(decoder, attr, None)
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__} to shard")


def apply_fsdp(root: nn.Module, blocks: list[nn.Module], mesh: Any, *, param_dtype: torch.dtype,
               offload: bool) -> None:
    """Shard ``root`` over ``mesh`` with FSDP2: each block on its own, then the root.

    torchtitan's shape: a block's parameters are gathered just before its forward and freed
    after it (and again in backward), so at most one block is whole at a time; the root holds
    what is left (embeddings, final norm, LM head; tied weights stay together). Parameters are
    cast to ``param_dtype`` for compute, gradients are reduced in float32 into float32 master
    weights. ``offload`` keeps the shards, their gradients and the optimizer step on the CPU.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # pinned host memory needs an accelerator; on a CPU mesh the shards are already host memory
    pinned = mesh.device_type != "cpu"
    offload_policy = CPUOffloadPolicy(pin_memory=pinned) if offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(root, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)


def _is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: Tensor) -> Tensor:
    """The whole tensor behind a shard (an all-gather: every rank must ask), or ``t`` itself."""
    return t.full_tensor() if _is_sharded(t) else t  # type: ignore[attr-defined]


def _load_full_state(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy a full (unsharded) state dict into ``module``, sharded or not, without collectives."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for name, t in module.state_dict().items():
            if name not in state:
                continue
            src = state[name]
            if _is_sharded(t):
                # every rank holds the full tensor: each takes its own shard, no scatter
                src = distribute_tensor(src.to(t.device, t.dtype), t.device_mesh, t.placements,
                                        src_data_rank=None).to_local()
                t = t.to_local()
            t.copy_(src)


def _local_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with each DTensor replaced by this rank's shard."""
    per_param = {k: {n: (v.to_local() if _is_sharded(v) else v) for n, v in st.items()}
                 for k, st in state["state"].items()}
    return {"state": per_param, "param_groups": state["param_groups"]}


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load `_local_state` output back: shards become DTensors shaped like their parameters."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(state)
    for p, st in optimizer.state.items():
        if not _is_sharded(p):
            continue
        for name, v in st.items():
            if isinstance(v, Tensor) and not _is_sharded(v) and v.shape == p.to_local().shape:
                st[name] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                              shape=p.shape, stride=p.stride(), run_check=False)


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
# On a GPU the chunks are 8x larger (512 MiB): the step there is bound by kernel launches, and
# a training forward keeps every chunk's logits for its backward anyway, so larger chunks cost
# no peak memory there (profile: Qwen2.5-0.5B shape, 8 rows x 384 response tokens, a 152k
# vocabulary: 30 chunks per forward at 64 MiB, 4 at 512 MiB; docs/benchmarks.md, GPU check).
LOGITS_CHUNK_GPU_FACTOR = 8


def _scales_logits(model: nn.Module) -> bool:
    """Whether the model post-processes its LM head's output (then the full forward is used)."""
    c = getattr(model, "config", None)
    return bool(getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None))


def _adamw(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW with the fused kernel (CPU and CUDA; measured 8x faster than the default on CPU)."""
    return torch.optim.AdamW(params, fused=True, **kwargs)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matrix products natively (not emulated through fp32).

    CPU: the AMX or AVX512-BF16 instruction sets (Linux ``/proc/cpuinfo`` flags); GPU: CUDA's
    own check (Ampere and later).
    """
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_native_bf16()


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype `train.mixed_precision` asks for on `device`; None: plain fp32."""
    if setting == "bf16" or (setting == "auto" and native_bf16(device)):
        return torch.bfloat16
    return None


def _use_eager_attention(model: nn.Module) -> None:
    """Plain matmul attention instead of SDPA: on CPU under bf16 autocast, SDPA's flash kernel
    (its backward above all) took 30% of a training pass, and eager attention made the pass
    measured 1.4-2x faster (bench: bf16 autocast, `small` model, 8 × 138 tokens)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")


class FrozenReference:
    """A copy of the learner's frozen reference model away from the learner (a rollout worker's,
    `placement.reference_on_rollout`): the log-probs of finished samples, at the learner's
    precision (`train.mixed_precision`), sampling temperature and micro-batching, so they stand
    in for the learner's own reference pass. Its weights come from the learner (`load`), since
    a warm start or a resumed checkpoint sets the reference apart from the model directory."""

    def __init__(self, cfg: TrainerConfig, model_dir: str | Path, *, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.device = torch.device(device)
        tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=cfg.model.trust_remote_code)
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=_dtype(cfg.model.dtype),
            trust_remote_code=cfg.model.trust_remote_code).to(self.device).eval().requires_grad_(False)
        self.autocast_dtype = autocast_dtype(cfg.train.mixed_precision, self.device)
        if self.device.type == "cpu" and self.autocast_dtype is not None:
            _use_eager_attention(self.model)
        self.run = ResponseLogprobs(self.model)

    def load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Take the learner's reference weights by name (`Learner.iter_named_weights(reference=True)`);
        every tensor of the model must come."""
        state = self.model.state_dict()
        seen: set[str] = set()
        with torch.no_grad():
            for name, t in named:
                if name not in state:
                    raise KeyError(f"reference weight {name!r} is not a tensor of this model")
                state[name].copy_(t)
                seen.add(name)
        missing = set(state) - seen
        if missing:
            raise ValueError(f"reference weights missing {len(missing)} tensors, e.g. {sorted(missing)[0]!r}")

    def logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Per response, the reference's log-prob of each of its tokens (an empty response is
        scored as the EOS token, as the learner trains it)."""
        cfg = self.cfg
        responses = [list(r) or [self.eos_id] for r in response_ids]
        temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        precision = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                     if self.autocast_dtype is not None else contextlib.nullcontext())
        q = cfg.train.pad_to_multiple
        ids, attn, index, mask = response_layout([list(p) for p in prompt_ids], responses, self.pad_id,
                                                 self.device, q)
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        with torch.no_grad(), precision:
            for c in micro_batches(attn.sum(dim=1), cfg.train.micro_batch_size, cfg.train.micro_batch_tokens, q):
                out[c] = chunk_logprobs(self.run, ids, attn, index, mask, c, temperature=temp, multiple=q)[0]
        out = out.cpu()
        return [out[i, : len(r)].tolist() for i, r in enumerate(responses)]


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
        self.sharded = cfg.train.strategy == "fsdp2"
        # sharded: loaded on the host, and only each rank's shards go to the device
        self.policy = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=_dtype(cfg.model.dtype),
            trust_remote_code=cfg.model.trust_remote_code).to("cpu" if self.sharded else self.device)
        if cfg.train.gradient_checkpointing:
            # non-reentrant: works under FSDP2 and with inputs that need no grad
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.autocast_dtype = autocast_dtype(cfg.train.mixed_precision, self.device)
        # FSDP2 computes in this dtype through its MixedPrecisionPolicy instead of autocast
        self.compute_dtype = self.autocast_dtype or torch.float32
        if self.device.type == "cpu" and self.autocast_dtype is not None:
            _use_eager_attention(self.policy)  # before the reference and critic copy it
        self.policy.train()
        self.reference: nn.Module | None = None
        if algo.kl_coef > 0 and algo.name != "sft":
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.critic: ValueModel | None = None
        self.critic_opt: torch.optim.Optimizer | None = None
        if algo.name == "ppo":
            self.critic = ValueModel(copy.deepcopy(self.policy)).to(self.policy.device)
        # the modules whose forward the trainer calls (the FSDP roots when sharded)
        self._forwards: dict[int, ResponseLogprobs] = {id(self.policy): ResponseLogprobs(self.policy)}
        if self.reference is not None:
            self._forwards[id(self.reference)] = ResponseLogprobs(self.reference)
        # under compile, the last micro-batch (batch attention mask, its rows, rows it ran with):
        # the shape `_idle_passes` runs, worked out only when one runs
        self._last_micro: tuple[Tensor, Tensor, int] | None = None
        if cfg.train.compile:
            # every block of every model shares one code object (its class's forward), compiled
            # once per variant: grad mode, which tensors need grad (policy, frozen reference,
            # critic), batches of one row (a row too long to pair with another, `_rows_floor`).
            # Sharded in bf16 with checkpointing, a policy and a reference make 8
            # (bench/gpu_check.py), a critic 10: past dynamo's default limit, 8, it runs the rest
            # eagerly without a word
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       COMPILE_VARIANTS)
            # each block on its own (torchtitan's order: compile, then shard); after the deep
            # copies, so that the reference and critic get compiled functions of their own
            for model in (self.policy, self.reference, self.critic and self.critic.backbone):
                for block in _transformer_blocks(model) if model is not None else []:
                    block.compile(dynamic=True)
        if self.sharded:
            self._shard()
        if self.critic is not None:
            self.critic_opt = _adamw(self.critic.parameters(), lr=algo.critic_lr)
        self.optimizer = _adamw(self.policy.parameters(), lr=cfg.train.lr,
                                weight_decay=cfg.train.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.train.lr_schedule, cfg.train.warmup_steps,
                                      cfg.train.max_steps))
        # replicated ranks average gradients in shared memory when they share a host, else over
        # the group during each step's last backward (FSDP2 reduce-scatters them itself)
        self.policy_grads = self._gradient_reducer(
            "policy", [p for p in self.policy.parameters() if p.requires_grad])
        self.critic_grads = (self._gradient_reducer("critic", list(self.critic.parameters()))
                             if self.critic is not None else None)
        self._grad_sync_s = 0.0  # this step's seconds in the gradient average (`_apply_gradients`)

    def _gradient_reducer(self, name: str, params: list[nn.Parameter]
                          ) -> SharedGradients | GradientBuckets | None:
        """What averages this module's gradients over the replicated ranks. None: nothing to
        average (one rank; FSDP2 reduce-scatters them itself), or `_all_reduce_grads` after the
        backward (`OVERLAP_GRAD_ALL_REDUCE` off)."""
        if self.group is None or self.sharded:
            return None
        if SHARED_MEMORY_GRADS and os.environ.get("YATT_SHM_GRADS", "1") != "0":
            shared, why_not = SharedGradients.open(self.group, params, key=self.group.key(f"yatt-grads-{name}"))
            if shared is not None:
                return shared
            if self.group.rank == 0:
                log.info("%s gradients averaged over %s, not shared memory: %s", name,
                         self.group.backend, why_not)
        return GradientBuckets(params, self.group) if OVERLAP_GRAD_ALL_REDUCE else None

    @staticmethod
    def _zero_grad(optimizer: torch.optim.Optimizer,
                   reducer: SharedGradients | GradientBuckets | None) -> None:
        if isinstance(reducer, SharedGradients):  # the gradients are views of its shared slot
            reducer.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)

    def _shard(self) -> None:
        """FSDP2 over the data-parallel group: policy, reference and critic, block by block."""
        if self.group is None:  # one rank still shards (a group of one), as on a single GPU
            from trainer import rendezvous

            _, port = rendezvous.host("127.0.0.1")
            self.group = DataParallelGroup("127.0.0.1", port, 0, 1,
                                           backend="nccl" if self.device.type == "cuda" else "gloo")
        self.mesh = self.group.device_mesh(self.device.type)
        offload = self.cfg.train.offload_optimizer
        dtype = self.compute_dtype
        apply_fsdp(self._forwards[id(self.policy)], _transformer_blocks(self.policy), self.mesh,
                   param_dtype=dtype, offload=offload)
        if self.reference is not None:  # frozen: sharded the same way, never offloaded
            apply_fsdp(self._forwards[id(self.reference)], _transformer_blocks(self.reference),
                       self.mesh, param_dtype=dtype, offload=False)
        if self.critic is not None:
            apply_fsdp(self.critic, _transformer_blocks(self.critic.backbone), self.mesh,
                       param_dtype=dtype, offload=offload)
        # FSDP2 initializes from the first forward, which must enter through the root: one pass
        # through each now, since `generate` (evaluation) would start at a block
        self._idle_passes(1, policy_old=True, reference=True, critic=True)
        for root in self._fsdp_roots():
            # FSDP2 leaves a root gathered after forward, for the backward that usually follows;
            # after a no-grad forward (reference, values, evaluation) none does, and the next
            # forward would run on the gathered copy from before the optimizer step
            root.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]
            root.reshard()  # type: ignore[operator]

    def _fsdp_roots(self) -> list[nn.Module]:
        roots: list[nn.Module] = [self._forwards[id(self.policy)]]
        if self.reference is not None:
            roots.append(self._forwards[id(self.reference)])
        if self.critic is not None:
            roots.append(self.critic)
        return roots

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision of RL forward passes: bf16 autocast (fp32 master weights) or fp32.

        Log-softmax, losses and optimizer state stay fp32: `_logprobs` upcasts the logits. A
        sharded learner computes in bf16 through FSDP2's MixedPrecisionPolicy instead.
        """
        if self.sharded or self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ batches and forwards
    def _layout(self, prompt_ids: list[list[int]], response_ids: list[list[int]]
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`response_layout` with this learner's pad token and `train.pad_to_multiple`, on its device."""
        return response_layout(prompt_ids, response_ids, self.pad_id, self.device, self.cfg.train.pad_to_multiple)

    def _micro_batches(self, lengths: Tensor) -> list[Tensor]:
        """`micro_batches` of rows with these sequence lengths, at this run's caps."""
        t = self.cfg.train
        return micro_batches(lengths, t.micro_batch_size, t.micro_batch_tokens, t.pad_to_multiple)

    def _logprobs(self, model: nn.Module, ids: Tensor, attn: Tensor, index: Tensor, *,
                  entropy: bool = False, entropy_grad: bool = True, temperature: float = 1.0,
                  response_only: bool = True) -> tuple[Tensor, Tensor | None]:
        """Response-aligned log-probs ``[B, T]`` (and entropies) of ``model`` on the batch."""
        run = self._forwards.get(id(model)) or ResponseLogprobs(model)
        return run(ids, attn, index, entropy=entropy, entropy_grad=entropy_grad,
                   temperature=temperature, response_only=response_only)

    def _values(self, ids: Tensor, attn: Tensor, index: Tensor) -> Tensor:
        assert self.critic is not None
        return self.critic(ids, attn)[:, :-1].float().gather(1, index)

    def _rows_floor(self, attn: Tensor, rows: Tensor) -> int:
        """How many rows a micro-batch of ``rows`` runs with: under `train.compile`, a lone row
        runs with a copy of itself where the caps (`train.micro_batch_size`,
        `train.micro_batch_tokens`) would take two rows of its width. Dynamo specializes a batch
        of one row, so meeting one mid-run compiles every block variant again: 10 s of a 6 s
        step when the rollout worker's reference share left the training rank one row
        (disaggregated, generation-heavy benchmark). A row alone because two would pass the
        token cap stays alone: such rows recur, and their variant is compiled once."""
        t = self.cfg.train
        if not t.compile or len(rows) != 1 or t.micro_batch_size < 2:
            return 1
        width = padded_length(int(attn[rows].sum()), t.pad_to_multiple, attn.shape[1])
        return 2 if t.micro_batch_tokens is None or 2 * width <= t.micro_batch_tokens else 1

    def _chunk_logprobs(self, model: nn.Module, ids: Tensor, attn: Tensor, index: Tensor, mask: Tensor,
                        rows: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """`chunk_logprobs` of ``model`` (through its FSDP root when sharded)."""
        run = self._forwards.get(id(model)) or ResponseLogprobs(model)
        min_rows = self._rows_floor(attn, rows)
        self._note_micro(attn, rows, min_rows)
        return chunk_logprobs(run, ids, attn, index, mask, rows, multiple=self.cfg.train.pad_to_multiple,
                              min_rows=min_rows, **kwargs)

    def _chunk_values(self, ids: Tensor, attn: Tensor, index: Tensor, mask: Tensor, rows: Tensor) -> Tensor:
        trimmed, pad = _trimmed(ids, attn, index, mask, rows, self.cfg.train.pad_to_multiple)
        min_rows = self._rows_floor(attn, rows)
        self._note_micro(attn, rows, min_rows)
        values = self._values(*_with_copies(trimmed, min_rows))
        return F.pad(values[: len(rows)], (0, pad))

    def _note_micro(self, attn: Tensor, rows: Tensor, min_rows: int) -> None:
        """Under `train.compile` on a sharded learner, remember the micro-batch the blocks last ran
        (`_idle_shape` reads its shape, only when an idle pass needs it)."""
        if self.cfg.train.compile and self.sharded and len(rows):
            self._last_micro = (attn, rows, min_rows)

    def _idle_shape(self) -> tuple[int, int, bool]:
        """Rows, width and whether a row is padded, of `_idle_passes`: one row of two tokens, or
        under `train.compile` the last micro-batch's (two rows before any). HF passes the blocks
        no mask without padding and a mask with it: two variants."""
        if not self.cfg.train.compile:
            return 1, 2, False
        if self._last_micro is None:
            return (2 if self.cfg.train.micro_batch_size >= 2 else 1), 2, False
        attn, rows, min_rows = self._last_micro
        lengths = attn[rows].sum(dim=1)
        width = padded_length(int(lengths.max()), self.cfg.train.pad_to_multiple, attn.shape[1])
        return max(len(rows), min_rows), width, bool((lengths < width).any())

    def _idle_passes(self, count: int, *, train: bool = False, policy_old: bool = False,
                     reference: bool = False, critic: bool = False, temperature: float = 1.0) -> None:
        """Run ``count`` passes on a one-token, masked-out micro-batch (sharded learner only).

        Under FSDP2 each forward and backward all-gathers and reduce-scatters, so a rank with
        fewer micro-batches than the others (or none) runs these instead: the same collectives
        in the same order, and gradients of exactly zero. Under `train.compile` they run at the
        shape of this rank's last micro-batch (`_idle_shape`; two rows before any) instead of
        one row of two tokens: dynamo specializes a batch of one row, and HF gives the blocks no
        mask where nothing is padded, so the first idle pass compiled the blocks again, mid-run.
        """
        if count <= 0:
            return
        rows, width, padded = self._idle_shape()
        ids = torch.full((rows, width), self.eos_id, dtype=torch.long, device=self.device)
        attn = torch.ones_like(ids)
        if padded:
            attn[-1, -1] = 0
        index = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        for _ in range(count):
            if train:
                lp, ent = self._logprobs(self.policy, ids, attn, index, entropy=True,
                                         temperature=temperature)
                assert ent is not None
                ((lp.sum() + ent.sum()) * 0.0).backward()
                if critic and self.critic is not None:
                    (self._values(ids, attn, index).sum() * 0.0).backward()
                continue
            with torch.no_grad():
                if policy_old:
                    self._logprobs(self.policy, ids, attn, index, temperature=temperature)
                if reference and self.reference is not None:
                    self._logprobs(self.reference, ids, attn, index, temperature=temperature)
                if critic and self.critic is not None:
                    self._values(ids, attn, index)

    # ------------------------------------------------------------------ distributed
    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def _all_reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Average gradients over the group in place after the backward (SFT; RL steps without
        `GradientBuckets`), one collective per tensor, all in flight at once (no flat copy of
        every gradient: measured 0.3 s per step for 17M parameters)."""
        if self.group is None or self.sharded:  # FSDP2 reduce-scatters them during backward
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

    def all_reduce_max(self, value: int) -> int:
        """The largest ``value`` over the group (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        if self.group is not None:
            self.group.all_reduce(t, op="max")
        return int(t.item())

    # ------------------------------------------------------------------ SFT
    def sft_step(self, prompts: list[str], targets: list[str], optimizer: torch.optim.Optimizer
                 ) -> dict[str, float]:
        """One supervised step on prompt → target + EOS; returns loss/sft and grad_norm."""
        tok = self.tokenizer
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        r_ids = [tok(t, add_special_tokens=False)["input_ids"] + [self.eos_id] for t in targets]
        # the full forward at the batch's own width, as before: the SFT warm start keeps its
        # numerics (its accuracy jump after a fixed number of steps is sensitive to them; see
        # bench/learn_check.py)
        ids, attn, index, mask = response_layout(p_ids, r_ids, self.pad_id, self.device)
        self._zero_grad(optimizer, self.policy_grads)
        lp, _ = self._logprobs(self.policy, ids, attn, index, response_only=False)
        loss = -A.masked_mean(lp, mask)  # token-mean cross entropy on the completion
        loss.backward()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if isinstance(self.policy_grads, SharedGradients):
            self.policy_grads.wait()
        else:
            self._all_reduce_grads(params)
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip))
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
        self._grad_sync_s = 0.0
        if self._queue_applies():
            return self._queued_rl_step(batch, recorder)
        if self.group is not None and self.world_size > 1 and cfg.train.balance_ranks != "off":
            batch, balance = self._balanced(batch)
            metrics.update(balance)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        rows = len(batch)
        returns: Tensor | None = None
        adv_tok: Tensor | None = None
        chunks: list[Tensor] = []
        if rows:
            ids, attn, index, mask = self._layout(batch.prompt_ids, batch.response_ids)
            chunks = self._micro_batches(attn.sum(dim=1))
        n_chunks = len(chunks)
        # the reference pass runs on the rows whose reference log-probs did not come with them
        given_ref, ref_chunks = (self._given_reference(batch, attn, mask, chunks)
                                 if rows and self.reference is not None else (None, chunks))
        # sharded: every rank runs as many micro-batches as the rank with the most (collectives)
        passes = self.all_reduce_max(n_chunks) if self.sharded else n_chunks
        idle = passes - n_chunks
        ref_idle = 0
        if self.reference is not None:
            ref_idle = (self.all_reduce_max(len(ref_chunks)) if self.sharded else len(ref_chunks)) - len(ref_chunks)
        kl_old = algo.kl_in_reward and self.reference is not None
        if rows:
            scores = self._scores(batch, mask)
            behaviour, has_behaviour = self._behaviour_logprobs(batch, mask)

            ref_span = recorder.span("reference") if recorder is not None else contextlib.nullcontext()
            with torch.no_grad(), ref_span, self.autocast():
                old_lp = None
                if kl_old:
                    # the KL shapes the reward, so the policy's log-probs are needed up front
                    self.policy.eval()
                    old_lp = in_row_order(chunks, [self._chunk_logprobs(
                        self.policy, ids, attn, index, mask, c, temperature=temp)[0] for c in chunks])
                    self._idle_passes(idle, policy_old=True, temperature=temp)
                    self.policy.train()
                ref_lp = kl_r = None
                if self.reference is not None:
                    assert given_ref is not None
                    ref_lp = given_ref
                    for c in ref_chunks:
                        ref_lp[c] = self._chunk_logprobs(self.reference, ids, attn, index, mask, c,
                                                         temperature=temp)[0]
                    self._idle_passes(ref_idle, reference=True, temperature=temp)
                    passed = sum(len(c) for c in ref_chunks)  # rows this rank's reference pass ran on
                    metrics["reference/rows"] = float(passed)
                    metrics["reference/given_frac"] = 1.0 - passed / rows
                    if old_lp is not None:
                        kl_r = A.kl_penalty(old_lp, ref_lp, algo.kl_estimator) * mask
                values = None
                if self.critic is not None:
                    values = in_row_order(chunks, [self._chunk_values(ids, attn, index, mask, c)
                                                   for c in chunks]) * mask
                    self._idle_passes(idle, critic=True)

                adv_tok, returns = self._token_advantages(scores, mask, batch.n, kl_r, values)
                if values is not None:
                    metrics["critic/value_mean"] = float(A.masked_mean(values, mask))
            tokens, total, square = _moments(adv_tok, mask)
            local = [tokens, float(rows), total, square]
        else:
            if algo.name not in ("grpo", "rloo", "reinforce_pp", "ppo"):
                raise ValueError(f"algorithm {algo.name!r} is not an RL algorithm")
            local = [0.0, 0.0, 0.0, 0.0]
            # the passes the other ranks run on their rows, module by module in the same order
            self._idle_passes(idle if kl_old else 0, policy_old=True, temperature=temp)
            self._idle_passes(ref_idle, reference=True, temperature=temp)
            self._idle_passes(idle if self.critic is not None else 0, critic=True)
        # One collective on every rank: the global batch's size and its advantage moments.
        g_tokens, g_rows, adv_sum, adv_sq = self.all_reduce_sum(local)
        if rows and adv_tok is not None and algo.name in ("ppo", "reinforce_pp"):
            # whitened over the whole data-parallel batch, not per rank
            adv_tok = _whitened(adv_tok, mask, g_tokens, adv_sum, adv_sq)
        if rows:
            assert adv_tok is not None
            metrics["advantage/mean"] = float(A.masked_mean(adv_tok, mask))
            metrics["advantage/abs_mean"] = float(A.masked_mean(adv_tok.abs(), mask))

        world = self.world_size
        sums = {"loss/policy": 0.0, "loss/kl": 0.0, "loss/value": 0.0, "entropy": 0.0,
                "clip_frac": 0.0, "loss/total": 0.0, "kl/mean": 0.0}
        off = {"diff": 0.0, "weight": 0.0, "capped": 0.0, "tokens": 0.0}
        old_chunks: list[Tensor] = []
        grad_norms: list[float] = []
        metric_weight = 0.0
        for epoch in range(cfg.train.ppo_epochs):
            self._zero_grad(self.optimizer, self.policy_grads)
            if self.critic_opt is not None:
                self._zero_grad(self.critic_opt, self.critic_grads)
            for k, c in enumerate(chunks if rows else []):
                m = mask[c]
                last = k == len(chunks) - 1  # its backward launches the gradient all-reduce
                for buckets in (self.policy_grads, self.critic_grads) if last else ():
                    if buckets is not None:
                        buckets.arm()
                # this chunk's share of the global batch's loss (gradients are averaged over ranks)
                # mw: its weight in the step's loss metrics (`_global_means`)
                mw = float(m.sum()) if algo.loss_agg == "token_mean" else float(len(c))
                w = mw / max(g_tokens if algo.loss_agg == "token_mean" else g_rows, 1.0) * world
                metric_weight += mw
                # before any update the policy is the proximal policy: its log-probs are "old"
                old = old_chunks[k] if epoch else (old_lp[c] if old_lp is not None else None)
                old_c = self._train_micro_batch(
                    (ids, attn, index, mask), c, adv_tok[c], behaviour[c], has_behaviour[c],
                    ref_lp[c] if ref_lp is not None else None, old, w, mw, sums,
                    off if epoch == 0 else None, temperature=temp)
                if epoch == 0:
                    old_chunks.append(old_c)
                if last and self.policy_grads is not None:
                    self.policy_grads.flush()  # on every rank the policy's collectives come first
                if self.critic is not None:
                    assert values is not None and returns is not None
                    with self.autocast():
                        v = self._chunk_values(ids, attn, index, mask, c)
                    vl, _ = A.value_loss(v, values[c], returns[c], m)
                    (vl * w).backward()
                    sums["loss/value"] += mw * float(vl.detach())
            self._idle_passes(idle, train=True, critic=self.critic is not None, temperature=temp)
            grad_norms.append(self._apply_gradients(params, self.optimizer, self.policy_grads))
            if self.critic is not None:
                assert self.critic_opt is not None
                self._apply_gradients(list(self.critic.parameters()), self.critic_opt,
                                      self.critic_grads)
        self.scheduler.step()
        lr = self.scheduler.get_last_lr()[0]
        if world > 1:
            # seconds in the gradient average after this rank's backward: the reduce itself and the
            # wait for slower ranks (FSDP2 reduce-scatters inside the backward: about zero there)
            metrics["time/grad_sync"] = self._grad_sync_s
        overall = self._global_means(metric_weight, sums, off)
        if not rows:
            return {**metrics, "train/empty_batch": 1.0, "lr": lr,
                    "grad_norm": sum(grad_norms) / len(grad_norms)}
        metrics.update(overall)
        if self.reference is None:
            metrics.pop("kl/mean", None)
        if self.reference is None or algo.kl_in_reward:
            metrics.pop("loss/kl", None)
        if self.critic is None:
            metrics.pop("loss/value", None)
        if batch.staleness is not None:
            metrics["rollout/stale_frac"] = sum(s > 0 for s in batch.staleness) / rows
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["lr"] = lr
        metrics["trained_tokens"] = float(mask.sum())
        return metrics

    def _token_advantages(self, scores: Tensor, mask: Tensor, n: int, kl_r: Tensor | None = None,
                          values: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Rows' token advantages ``[B, T]`` before any whitening, and a critic's returns (PPO),
        from their scores, a KL in the reward ``kl_r`` (per token, or None) and the critic's
        ``values``: per prompt group of ``n`` for GRPO and RLOO, discounted returns for
        REINFORCE++, GAE for PPO."""
        algo = self.cfg.algorithm
        if algo.name in ("grpo", "rloo"):
            seq_scores = scores - (algo.kl_coef * kl_r.sum(dim=1) if kl_r is not None else 0.0)
            if algo.name == "grpo":
                adv = A.grpo_advantages(seq_scores, n, algo.norm_adv_by_std)
            else:
                adv = A.rloo_advantages(seq_scores, n)
            return adv.unsqueeze(1).expand_as(mask) * mask, None
        if algo.name == "reinforce_pp":
            return A.discounted_returns(A.token_rewards(scores, mask, kl_r, algo.kl_coef), mask,
                                        algo.gamma), None
        if algo.name == "ppo":
            assert values is not None
            tok_r = A.token_rewards(scores, mask, kl_r, algo.kl_coef)
            return A.gae_advantages(tok_r, values, mask, algo.gamma, algo.lam)
        raise ValueError(f"algorithm {algo.name!r} is not an RL algorithm")

    def _queue_applies(self) -> bool:
        """Whether `train.balance_ranks: queue` takes this step (else it deals groups): ranks that
        run their passes apart (under FSDP2 every pass is a collective)."""
        return (self.group is not None and self.world_size > 1 and not self.sharded
                and self.cfg.train.balance_ranks == "queue")

    def _queue_prepass(self) -> bool:
        """Whether the queued step's advantages need more than each share's own scores: the
        policy's and the reference's log-probs for a KL in the reward, the critic's values, or
        every row of the batch (advantages whitened over it: PPO, REINFORCE++)."""
        algo = self.cfg.algorithm
        return ((algo.kl_in_reward and self.reference is not None) or self.critic is not None
                or algo.name in ("ppo", "reinforce_pp"))

    def _share(self, batch: RLBatch) -> _Share:
        """A rank's rows laid out as every rank that trains a micro-batch of them needs them, with
        their advantages unless they wait for the step's passes before training
        (`_queue_prepass`)."""
        if not len(batch):
            return _Share(batch, [])
        ids, attn, index, mask = self._layout(batch.prompt_ids, batch.response_ids)
        chunks = self._micro_batches(attn.sum(dim=1))
        behaviour, has = self._behaviour_logprobs(batch, mask)
        share = _Share(batch, chunks, ids, attn, index, mask, None, behaviour, has)
        if not self._queue_prepass():
            share.adv, _ = self._token_advantages(self._scores(batch, mask), mask, batch.n)
        if self.reference is not None:
            share.ref_lp, todo = self._reference_rows(batch, mask)
            share.ref_todo = torch.zeros(len(batch), dtype=torch.bool, device=mask.device)
            share.ref_todo[todo] = True
        return share

    def _take_micro_batches(self, key: str, counter: str, shares: dict[int, _Share],
                            work: Callable[[_Share, Tensor, bool], None]) -> float:
        """Run ``work(share, micro_batch, own)`` on micro-batches taken from the store until every
        rank's are taken: this rank's own first, then the next of any rank that has published its
        rows (``{key}/rows/{rank}``); rank r's next micro-batch is counted at
        ``{key}/{counter}/{r}``. ``shares`` gains every rank's rows as they are read. Returns the
        seconds spent waiting for a rank to publish, with nothing to take."""
        assert self.group is not None
        store, rank, world = self.group.store, self.group.rank, self.world_size
        order = [rank, *(r for r in range(world) if r != rank)]
        done: set[int] = set()
        waited = 0.0
        while len(done) < world:
            took = False
            for r in order:
                if r in done:
                    continue
                if r not in shares:
                    if not store.check([f"{key}/rows/{r}"]):
                        continue
                    shares[r] = self._share(_unpack_rows(store.get(f"{key}/rows/{r}")))
                share = shares[r]
                i = store.add(f"{key}/{counter}/{r}", 1) - 1
                if i >= len(share.chunks):
                    done.add(r)
                    continue
                work(share, share.chunks[i], r == rank)
                took = True
                break  # back to this rank's own micro-batches first
            if not took and len(done) < world:  # nothing to take until another rank publishes
                late = [f"{key}/rows/{r}" for r in order if r not in shares]
                start = time.perf_counter()
                if len(late) == 1:
                    store.wait(late)
                else:  # the store waits for all of some keys, not for any one of them
                    while not any(store.check([k]) for k in late):
                        time.sleep(1e-3)
                waited += time.perf_counter() - start
        return waited

    def _queued_passes(self, key: str, shares: dict[int, _Share], recorder: Any,
                       temperature: float) -> tuple[float, float]:
        """The queued step's passes before its advantages (`_queue_prepass`), shared through the
        store like the training: the proximal policy's log-probs where the KL is in the reward,
        the reference's where they did not come with the rows, the critic's values. Each
        micro-batch's results are summed into every rank in one all-reduce, and every rank then
        computes every share's advantages (the same inputs, the same numbers): whitened over the
        whole batch for PPO and REINFORCE++, per prompt group for GRPO and RLOO. Returns the
        seconds this rank waited for another to publish, and the rows of its reference pass."""
        assert self.group is not None
        algo = self.cfg.algorithm
        kl_old = algo.kl_in_reward and self.reference is not None
        # the same on every rank (no rank knows yet whether the others' rows need a reference pass)
        passes = kl_old or self.critic is not None or self.reference is not None
        ref_rows = 0.0

        def prepare(share: _Share) -> None:
            if share.mask is not None and share.here is None:
                share.here = torch.zeros(len(share.batch), dtype=torch.bool, device=share.mask.device)
                if kl_old:
                    share.old_lp = torch.zeros_like(share.mask, dtype=torch.float32)
                if self.critic is not None:
                    share.values = torch.zeros_like(share.mask, dtype=torch.float32)

        def pass_over(share: _Share, c: Tensor, own: bool) -> None:
            nonlocal ref_rows
            prepare(share)
            assert share.ids is not None and share.attn is not None and share.index is not None
            assert share.mask is not None and share.here is not None
            args = (share.ids, share.attn, share.index, share.mask)
            span = recorder.span("reference") if recorder is not None else contextlib.nullcontext()
            with torch.no_grad(), span, self.autocast():
                if share.old_lp is not None:
                    self.policy.eval()
                    share.old_lp[c] = self._chunk_logprobs(self.policy, *args, c,
                                                           temperature=temperature)[0]
                    self.policy.train()
                if share.ref_lp is not None and share.ref_todo is not None:
                    todo = c[share.ref_todo[c]]
                    if len(todo):
                        share.ref_lp[todo] = self._chunk_logprobs(self.reference, *args, todo,
                                                                  temperature=temperature)[0]
                        ref_rows += len(todo)
                if share.values is not None:
                    share.values[c] = self._chunk_values(*args, c).float()
            share.here[c] = True

        waited = 0.0
        if passes:
            waited = self._take_micro_batches(key, "pass", shares, pass_over)
        else:  # nothing to pass: the advantages need every rank's rows, so wait for them all
            start = time.perf_counter()
            self.group.store.wait([f"{key}/rows/{r}" for r in range(self.world_size)])
            waited = time.perf_counter() - start
            for r in range(self.world_size):
                if r not in shares:
                    shares[r] = self._share(_unpack_rows(self.group.store.get(f"{key}/rows/{r}")))
        ordered = [shares[r] for r in range(self.world_size) if shares[r].mask is not None]
        for share in ordered:
            prepare(share)
        # each row's results were computed by one rank: a sum over ranks of zero-filled buffers
        parts: list[tuple[_Share, str, Tensor]] = []
        for share in ordered:
            assert share.here is not None
            for name in ("old_lp", "ref_lp", "values"):
                t = getattr(share, name)
                if t is None:
                    continue
                rows = share.here & share.ref_todo if name == "ref_lp" else share.here
                assert rows is not None
                parts.append((share, name, t * rows.unsqueeze(1)))
        if parts:  # nothing to sum when nothing was passed
            flat = torch.cat([p.reshape(-1).float() for _, _, p in parts]).to(self.device)
            self.group.all_reduce(flat)
            at = 0
            for share, name, p in parts:
                got = flat[at: at + p.numel()].view_as(p).to(p.device, p.dtype)
                at += p.numel()
                if name == "ref_lp":
                    assert share.ref_todo is not None and share.ref_lp is not None
                    share.ref_lp[share.ref_todo] = got[share.ref_todo]
                else:
                    setattr(share, name, got)
        self._queued_advantages(ordered)
        return waited, ref_rows

    def _queued_advantages(self, shares: list[_Share]) -> None:
        """Every share's token advantages (and a critic's returns), as `rl_step` computes them over
        the whole batch, from the results of `_queued_passes`."""
        algo = self.cfg.algorithm
        kl_old = algo.kl_in_reward and self.reference is not None
        tokens = total = square = 0.0
        for share in shares:
            assert share.mask is not None
            mask = share.mask
            scores = self._scores(share.batch, mask)
            kl_r = None
            if kl_old:
                assert share.old_lp is not None and share.ref_lp is not None
                kl_r = A.kl_penalty(share.old_lp, share.ref_lp, algo.kl_estimator) * mask
            if share.values is not None:
                share.values = share.values * mask
            share.adv, share.returns = self._token_advantages(scores, mask, share.batch.n, kl_r,
                                                              share.values)
            moments = _moments(share.adv, mask)
            tokens, total, square = tokens + moments[0], total + moments[1], square + moments[2]
        if algo.name in ("ppo", "reinforce_pp"):  # whitened over the whole data-parallel batch
            for share in shares:
                assert share.adv is not None and share.mask is not None
                share.adv = _whitened(share.adv, share.mask, tokens, total, square)

    def _queued_rl_step(self, batch: RLBatch, recorder: Any = None) -> dict[str, float]:
        """`rl_step` with `train.balance_ranks: queue`: the ranks share the step's micro-batches
        through the group's store instead of dealing rows at a meeting.

        Each rank publishes its rows as it arrives and takes its own micro-batches (longest first)
        from a counter in the store; a rank out of work takes the next micro-batch of a rank that
        has published, and waits only while a rank has yet to publish (`_take_micro_batches`). A
        micro-batch's forward and backward run on the rank that takes it. The loss weights need
        the global token count, which is known only when every rank has arrived: each
        micro-batch's loss is weighted by its own tokens (rows, for ``seq_mean``) and the summed
        gradient is divided by the global count after the average, which gives `rl_step`'s
        gradient. One counter add per micro-batch; the gradient average runs after the last
        backward (no rank knows in advance which backward is its last).

        GRPO and RLOO with the KL in the loss (or none) train at once: a micro-batch's advantages
        come from its own prompt groups' scores, and its reference pass runs where it is trained.
        Otherwise the passes the advantages need are shared first, the same way, and their
        results exchanged (`_queued_passes`): a KL in the reward, a critic's values, advantages
        whitened over the batch.

        With `train.ppo_epochs` above 1 the queue shares the first epoch, and every later epoch
        replays it: each rank trains again the micro-batches it took, against the proximal
        log-probs its first pass over them gave (the first epoch's sharing was measured, so the
        replay is as even; nothing goes through the store again).
        """
        assert self.group is not None
        cfg, algo = self.cfg, self.cfg.algorithm
        if algo.name not in ("grpo", "rloo", "reinforce_pp", "ppo"):
            raise ValueError(f"algorithm {algo.name!r} is not an RL algorithm")
        temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        store, rank, world = self.group.store, self.group.rank, self.world_size
        key = self.group.key("rl-step")
        payload = _pack_rows(batch)
        store.set(f"{key}/rows/{rank}", payload)
        shares = {rank: self._share(_unpack_rows(payload))}  # as the other ranks will see them
        token_mean = algo.loss_agg == "token_mean"
        sums = {"loss/policy": 0.0, "loss/kl": 0.0, "entropy": 0.0, "clip_frac": 0.0,
                "loss/total": 0.0, "kl/mean": 0.0}
        if self.critic is not None:
            sums["loss/value"] = 0.0
        off = {"diff": 0.0, "weight": 0.0, "capped": 0.0, "tokens": 0.0}
        weight = tokens = taken = ref_rows = 0.0  # this rank's: loss weight, tokens, others' tokens
        waited = 0.0
        if self._queue_prepass():
            waited, ref_rows = self._queued_passes(key, shares, recorder, temp)
        self._zero_grad(self.optimizer, self.policy_grads)
        if self.critic_opt is not None:
            self._zero_grad(self.critic_opt, self.critic_grads)
        mine: list[tuple[_Share, Tensor, Tensor]] = []  # (rows, micro-batch, proximal log-probs)

        def train(share: _Share, c: Tensor, old: Tensor | None = None, first: bool = True) -> Tensor:
            nonlocal ref_rows
            assert share.ids is not None and share.attn is not None and share.index is not None
            assert share.mask is not None and share.adv is not None
            assert share.behaviour is not None and share.has_behaviour is not None
            args = (share.ids, share.attn, share.index, share.mask)
            m = share.mask[c]
            ref_c = None
            if share.ref_lp is not None and share.ref_todo is not None:
                todo = c[share.ref_todo[c]] if share.here is None else c[:0]  # else passed before
                if len(todo):
                    span = recorder.span("reference") if recorder is not None else contextlib.nullcontext()
                    with torch.no_grad(), span, self.autocast():
                        share.ref_lp[todo] = self._chunk_logprobs(self.reference, *args, todo,
                                                                  temperature=temp)[0]
                    ref_rows += len(todo)
                ref_c = share.ref_lp[c]
            if old is None and share.old_lp is not None:
                old = share.old_lp[c]  # the KL in the reward took the proximal log-probs up front
            wt = float(m.sum()) if token_mean else float(len(c))
            # the policy being trained is the proximal policy in the first epoch; the loss is
            # divided by the global weight after the average
            old_c = self._train_micro_batch(args, c, share.adv[c], share.behaviour[c],
                                            share.has_behaviour[c], ref_c, old, wt, wt, sums,
                                            off if first else None, temperature=temp)
            if self.critic is not None:
                assert share.values is not None and share.returns is not None
                with self.autocast():
                    v = self._chunk_values(*args, c)
                vl, _ = A.value_loss(v, share.values[c], share.returns[c], m)
                (vl * wt).backward()
                sums["loss/value"] += wt * float(vl.detach())
            return old_c

        def first_epoch(share: _Share, c: Tensor, own: bool) -> None:
            nonlocal weight, tokens, taken
            assert share.mask is not None
            mine.append((share, c, train(share, c)))
            m = float(share.mask[c].sum())
            weight += m if token_mean else float(len(c))
            tokens += m
            if not own:
                taken += m

        waited += self._take_micro_batches(key, "next", shares, first_epoch)
        # One collective on every rank: the global weight, and each rank's own and trained tokens.
        own = shares[rank]
        own_tokens = float(own.mask.sum()) if own.mask is not None else 0.0
        local = [weight, *(own_tokens if r == rank else 0.0 for r in range(world)),
                 *(tokens if r == rank else 0.0 for r in range(world))]
        totals = self.all_reduce_sum(local)
        g_weight, before, after = totals[0], totals[1: 1 + world], totals[1 + world:]
        for counter in ("rows", "pass", "next"):  # every rank is past its last read of them
            store.delete_key(f"{key}/{counter}/{rank}")
        self._grad_sync_s = 0.0
        params = [p for p in self.policy.parameters() if p.requires_grad]
        scale = world / max(g_weight, 1.0)

        def apply() -> float:
            norm = self._apply_gradients(params, self.optimizer, self.policy_grads, scale=scale)
            if self.critic is not None:
                assert self.critic_opt is not None
                self._apply_gradients(list(self.critic.parameters()), self.critic_opt,
                                      self.critic_grads, scale=scale)
            return norm

        grad_norms = [apply()]
        for _ in range(1, cfg.train.ppo_epochs):
            self._zero_grad(self.optimizer, self.policy_grads)
            if self.critic_opt is not None:
                self._zero_grad(self.critic_opt, self.critic_grads)
            for share, c, old_c in mine:
                train(share, c, old_c, first=False)
            grad_norms.append(apply())
        overall = self._global_means(weight * cfg.train.ppo_epochs, sums, off)
        grad_norm = sum(grad_norms) / len(grad_norms)
        self.scheduler.step()
        mean = max(sum(before) / world, 1.0)
        metrics: dict[str, float] = {
            "time/rank_wait": waited, "time/grad_sync": self._grad_sync_s,
            "train/rank_load_before": max(before) / mean, "train/rank_load_after": max(after) / mean,
            "train/taken_frac": taken / max(tokens, 1.0),
            "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm}
        if not tokens:  # its own rows taken by the others, or none came
            metrics["train/empty_batch"] = 1.0
        if len(batch):
            assert own.adv is not None and own.mask is not None
            metrics["advantage/mean"] = float(A.masked_mean(own.adv, own.mask))
            metrics["advantage/abs_mean"] = float(A.masked_mean(own.adv.abs(), own.mask))
            if own.values is not None:
                metrics["critic/value_mean"] = float(A.masked_mean(own.values, own.mask))
            if batch.staleness is not None:
                metrics["rollout/stale_frac"] = sum(s > 0 for s in batch.staleness) / len(batch)
        if weight:
            metrics.update(overall)
            if self.reference is None:
                metrics.pop("kl/mean", None)
            if self.reference is None or algo.kl_in_reward:
                metrics.pop("loss/kl", None)
            metrics["trained_tokens"] = tokens
        if self.reference is not None and len(batch):
            assert own.ref_todo is not None
            metrics["reference/rows"] = ref_rows
            metrics["reference/given_frac"] = 1.0 - float(own.ref_todo.sum()) / len(batch)
        return metrics

    def _train_micro_batch(self, layout: tuple[Tensor, Tensor, Tensor, Tensor], c: Tensor, adv: Tensor,
                           behaviour: Tensor, has_behaviour: Tensor, ref_lp: Tensor | None,
                           old: Tensor | None, loss_weight: float, metric_weight: float,
                           sums: dict[str, float], off: dict[str, float] | None, *,
                           temperature: float) -> Tensor:
        """The policy's forward, loss and backward on micro-batch ``c`` of ``layout`` (its
        ``adv``, sampler and reference log-probs given for its rows), the loss scaled by
        ``loss_weight``. Adds its loss metrics, weighted by ``metric_weight``, to ``sums`` and,
        with ``off``, its sampler/trainer mismatch. Returns the proximal ("old") log-probs it
        used: ``old``, or this forward's own when None."""
        algo = self.cfg.algorithm
        m = layout[3][c]
        want_entropy_grad = algo.entropy_coef > 0
        with self.autocast():
            lp, ent = self._chunk_logprobs(self.policy, *layout, c, entropy=True,
                                           entropy_grad=want_entropy_grad, temperature=temperature)
        assert ent is not None
        old_c = lp.detach() if old is None else old
        log_w = (old_c - behaviour) * has_behaviour
        is_w = torch.exp(log_w)
        if algo.tis_cap > 0:
            is_w = is_w.clamp(max=algo.tis_cap)
        if off is not None:
            hm = m * has_behaviour
            off["diff"] += float((log_w.abs() * hm).sum())
            off["weight"] += float((is_w * hm).sum())
            off["capped"] += float(((torch.exp(log_w) > algo.tis_cap) * hm).sum()) if algo.tis_cap > 0 else 0.0
            off["tokens"] += float(hm.sum())
        pl, cf = A.policy_loss(lp, old_c, adv, m, algo.clip_ratio_low, algo.clip_ratio_high,
                               algo.loss_agg, is_weights=is_w)
        loss = pl
        if ref_lp is not None:
            kl_tok = A.kl_penalty(lp, ref_lp, algo.kl_estimator)
            kl_t = A.aggregate(kl_tok, m, algo.loss_agg)
            sums["kl/mean"] += metric_weight * float(A.masked_mean(kl_tok.detach(), m))
            if not algo.kl_in_reward:
                loss = loss + algo.kl_coef * kl_t
                sums["loss/kl"] += metric_weight * float(kl_t.detach())
        ent_agg = A.aggregate(ent if want_entropy_grad else ent.detach(), m, algo.loss_agg)
        if want_entropy_grad:
            loss = loss - algo.entropy_coef * ent_agg
        (loss * loss_weight).backward()
        sums["loss/policy"] += metric_weight * float(pl.detach())
        sums["entropy"] += metric_weight * float(ent_agg.detach())
        sums["clip_frac"] += metric_weight * float(cf)
        sums["loss/total"] += metric_weight * float(loss.detach())
        return old_c

    def _global_means(self, weight: float, sums: dict[str, float], off: dict[str, float]
                      ) -> dict[str, float]:
        """The step's loss metrics over the whole data-parallel batch: every rank's weighted sums
        (``weight``: its tokens, or rows for ``seq_mean``, over its micro-batches and epochs) and
        its sampler/trainer mismatch sums added up in one collective, so that every rank reports
        the same values however the ranks shared the micro-batches (a mean of each rank's own
        means would move with the sharing)."""
        names = list(sums)
        t = self.all_reduce_sum([weight, *(sums[k] for k in names),
                                 off["diff"], off["weight"], off["capped"], off["tokens"]])
        out = {k: t[1 + i] / t[0] for i, k in enumerate(names)} if t[0] > 0 else {}
        diff, is_weight, capped, tokens = t[-4:]
        if tokens:
            out.update({"rollout/logprob_diff": diff / tokens, "rollout/is_weight_mean": is_weight / tokens,
                        "rollout/is_capped_frac": capped / tokens})
        return out

    def _scores(self, batch: RLBatch, mask: Tensor) -> Tensor:
        """The batch's scores ``[B]``, with DAPO's overlong penalty where it is on."""
        cfg, algo = self.cfg, self.cfg.algorithm
        scores = torch.tensor(batch.scores, dtype=torch.float32, device=self.device)
        if algo.overlong_penalty > 0:
            buffer = max(1, cfg.rollout.max_new_tokens // 4)
            scores = scores + algo.overlong_penalty * A.overlong_penalty(
                mask.sum(dim=1), cfg.rollout.max_new_tokens, buffer).to(scores.device)
        return scores

    def _balanced(self, batch: RLBatch) -> tuple[RLBatch, dict[str, float]]:
        """This rank's share of the data-parallel batch, whole prompt groups dealt by `deal_groups`
        so that each rank passes about as many tokens: the ranks wait for the slowest at the
        gradient all-reduce, so one rank's long responses would hold them all.

        Only which rank computes which group changes: each micro-batch's loss weight is its share
        of the global tokens (or rows), so the averaged gradient is the same. Every rank gathers
        every group (token ids, scores, sampler and reference log-probs: small beside one gradient
        all-reduce) with two all-reduces over zero-filled buffers; a rank whose rows are not whole groups of
        ``batch.n`` leaves the batch as it is on every rank.
        """
        assert self.group is not None
        world, rank, n = self.world_size, self.group.rank, batch.n
        whole = n > 0 and len(batch) % n == 0
        ints, floats = _encode_rows(batch) if whole else ([], [])
        head = torch.zeros((world, 3), dtype=torch.int64)
        head[rank] = torch.tensor([len(batch) // n if whole else -1, len(ints), len(floats)])
        arrived = time.perf_counter()
        self.group.all_reduce(head)  # the first meeting of the step: here the ranks wait for the last
        waited = {"time/rank_wait": time.perf_counter() - arrived}
        if bool((head[:, 0] < 0).any()):
            return batch, waited
        int_at = [0, *torch.cumsum(head[:, 1], 0).tolist()]
        float_at = [0, *torch.cumsum(head[:, 2], 0).tolist()]
        all_ints = torch.zeros(int_at[-1], dtype=torch.int64)
        all_floats = torch.zeros(float_at[-1], dtype=torch.float64)
        all_ints[int_at[rank]: int_at[rank + 1]] = torch.tensor(ints, dtype=torch.int64)
        all_floats[float_at[rank]: float_at[rank + 1]] = torch.tensor(floats, dtype=torch.float64)
        self.group.all_reduce(all_ints)
        self.group.all_reduce(all_floats)
        groups: list[list[tuple]] = []  # every rank's groups, rank 0's first
        sources: list[int] = []
        for r in range(world):
            rows = _decode_rows(all_ints[int_at[r]: int_at[r + 1]].tolist(),
                                all_floats[float_at[r]: float_at[r + 1]].tolist(), int(head[r, 0]) * n)
            groups += [rows[k: k + n] for k in range(0, len(rows), n)]
            sources += [r] * (len(rows) // n)
        costs = [sum(len(row[0]) + len(row[1]) for row in g) for g in groups]
        owner = deal_groups(costs, world)
        before, after = [0] * world, [0] * world
        for g, cost in enumerate(costs):
            before[sources[g]] += cost
            after[owner[g]] += cost
        mean = max(sum(costs) / world, 1.0)
        mine = [row for g, rows in zip(owner, groups, strict=True) if g == rank for row in rows]
        out = _batch_of_rows(mine, n)
        # the slowest rank's tokens over the mean, as the ranks came and as dealt
        return out, {**waited, "train/rank_load_before": max(before) / mean,
                     "train/rank_load_after": max(after) / mean}

    def _given_reference(self, batch: RLBatch, attn: Tensor, mask: Tensor, chunks: list[Tensor]
                         ) -> tuple[Tensor, list[Tensor]]:
        """The reference log-probs ``[B, T]`` that came with the batch (zeros elsewhere) and the
        micro-batches of the rows still to pass through the reference: ``chunks`` when none came,
        else the other rows, micro-batched by the same rule."""
        rows = mask.shape[0]
        out, todo = self._reference_rows(batch, mask)
        if len(todo) == rows:
            return out, chunks
        if not todo:
            return out, []
        left = torch.tensor(todo, dtype=torch.long, device=attn.device)
        return out, [left[c] for c in self._micro_batches(attn[left].sum(dim=1))]

    def _reference_rows(self, batch: RLBatch, mask: Tensor) -> tuple[Tensor, list[int]]:
        """The reference log-probs ``[B, T]`` that came with the batch (zeros elsewhere) and the
        rows without them."""
        rows, length = mask.shape
        out = torch.zeros((rows, length), dtype=torch.float32)
        todo: list[int] = []
        for i, (refs, resp) in enumerate(zip(batch.ref_logprobs or [[]] * rows, batch.response_ids,
                                             strict=True)):
            if refs and len(refs) == len(resp):
                out[i, : len(refs)] = torch.tensor(refs, dtype=torch.float32)
            else:
                todo.append(i)
        return out.to(self.device), todo

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

    def _apply_gradients(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                         buckets: SharedGradients | GradientBuckets | None = None,
                         scale: float = 1.0) -> float:
        """All-reduce, clip and step: the same on every rank, with or without local gradients.

        ``buckets``: the all-reduce launched during the last backward, to finish here. ``scale``:
        multiplies the averaged gradients before clipping.
        """
        if self.sharded:  # the optimizer's own (sharded) parameters, whatever the module holds now
            params = [p for g in optimizer.param_groups for p in g["params"]]
        start = time.perf_counter()
        if buckets is not None:
            buckets.wait()
        else:
            self._all_reduce_grads(params)
        self._grad_sync_s += time.perf_counter() - start
        for p in params:
            if p.grad is None:  # a rank with nothing to train still steps on the averaged grads
                p.grad = torch.zeros_like(p)
        if scale != 1.0:
            torch._foreach_mul_([p.grad for p in params], scale)
        # sharded gradients: the norm is of the whole gradient (DTensor all-reduces the shards')
        norm = float(_full(torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)))
        optimizer.step()
        return norm

    # ------------------------------------------------------------------ eval and weights
    @torch.no_grad()
    def greedy(self, prompts: list[str], max_new_tokens: int, batch_size: int = 128) -> list[str]:
        """Greedy completions of `prompts` with the policy (held-out evaluation)."""
        self.policy.eval()
        out: list[str] = []
        try:
            # `train.compile`: decoding through the compiled blocks would compile a variant per
            # layer and KV-cache state (16 to 23 for the 8-block `small` model, 17 s on a CPU), and
            # a 28-block one would use up the recompile limit: its training step would run eagerly
            with self._whole_policy(), torch.compiler.set_stance("force_eager"):
                out = self._greedy(prompts, max_new_tokens, batch_size)
        finally:
            self.policy.train()
        return out

    @contextlib.contextmanager
    def _whole_policy(self) -> Iterator[None]:
        """Sharded: gather the whole policy for generation, every rank at once, then reshard.

        Greedy decoding runs as many forwards as its longest answer needs, a number that differs
        between ranks (and a rank may have no prompts); with the policy gathered up front they
        run no collectives.
        """
        if not self.sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        root = self._forwards[id(self.policy)]
        assert isinstance(root, FSDPModule)
        modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
        root.set_reshard_after_forward(False)
        for m in modules:
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
            root.set_reshard_after_forward(True)
            # Decoding records a different number of block forwards on each rank; FSDP2 would
            # plan the next backward's all-gather prefetches from them and the ranks' collectives
            # would no longer match. Forget them, as after an aborted iteration.
            if hasattr(root, "reset_iter_state"):  # torch >= 2.13
                root.reset_iter_state()
            else:
                state = root._get_fsdp_state()
                state._comm_ctx.post_forward_order.clear()
                for m in modules:
                    for group in m._get_fsdp_state()._fsdp_param_groups:
                        group._post_forward_indices.clear()

    def _greedy(self, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
        out: list[str] = []
        for i in range(0, len(prompts), batch_size):
            enc = self.tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True,
                                 add_special_tokens=False).to(self.device)
            gen = self.policy.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=self.pad_id, eos_token_id=self.eos_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            out.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
        return out

    def iter_named_weights(self, *, reference: bool = False) -> Iterator[tuple[str, Tensor]]:
        """The policy's weights by HF name, one tensor at a time, where they live (no host copy):
        what a sampler loads, in place or through trainer.weight_sync's broadcast. With
        ``reference``, the frozen reference's instead (for a `FrozenReference`).

        Sharded, each tensor is gathered (``full_tensor``, an all-gather) as it is asked for, so
        no whole copy of the model is ever built; every rank must drain the iterator.
        """
        model = self.reference if reference else self.policy
        if model is None:
            raise ValueError("this learner has no reference model (algorithm.kl_coef is 0)")
        for name, t in model.state_dict().items():
            yield name, _full(t).detach()

    def named_weights(self) -> dict[str, Tensor]:
        """All of `iter_named_weights` at once (views of the weights; sharded, a gathered copy)."""
        return dict(self.iter_named_weights())

    # ------------------------------------------------------------------ colocate
    def release_device(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (a GPU colocated with a
        sampler that generates meanwhile); a no-op on a CPU device. Untested without a GPU."""
        self._move_state("cpu")

    def reclaim_device(self) -> None:
        """Bring back what `release_device` moved, before the next training pass."""
        self._move_state(self.device)

    def _move_state(self, where: str | torch.device) -> None:
        if self.device.type == "cpu":
            return  # host memory already: nothing to free for the sampler
        offloaded = self.sharded and self.cfg.train.offload_optimizer  # shards live on the host
        modules: list[nn.Module] = self._fsdp_roots() if self.sharded else [
            m for m in (self.policy, self.reference, self.critic) if m is not None]
        for m in modules:
            if offloaded and m is not self._forwards.get(id(self.reference)):
                continue
            m.to(where)  # FSDP2 re-registers its shards after a move (FSDPModule._apply)
        if not offloaded:
            for opt in (self.optimizer, self.critic_opt):
                for state in (opt.state.values() if opt is not None else ()):
                    for k, v in state.items():
                        if isinstance(v, Tensor) and k != "step":
                            state[k] = v.to(where, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ checkpoints
    def full_state_dicts(self) -> dict[str, dict[str, Tensor] | None]:
        """Whole (gathered) state dicts of the policy, reference and critic, on CPU.

        A collective when sharded: every rank calls it; only rank 0 keeps the tensors (the
        others get None), since rank 0 writes them.
        """
        keep = self.group is None or self.group.rank == 0
        out: dict[str, dict[str, Tensor] | None] = {}
        for key, module in (("policy", self.policy), ("reference", self.reference),
                            ("critic", self.critic)):
            if module is None:
                out[key] = None
                continue
            state = {k: _full(v).detach().to("cpu") for k, v in module.state_dict().items()}
            out[key] = state if keep else None
        return out

    def load_full_state_dicts(self, reference: dict[str, Tensor] | None = None,
                              critic: dict[str, Tensor] | None = None) -> None:
        """Load whole reference/critic state dicts (from rank 0's checkpoint) on every rank."""
        if reference is not None and self.reference is not None:
            _load_full_state(self.reference, reference)
        if critic is not None and self.critic is not None:
            _load_full_state(self.critic, critic)

    def optimizer_state_dicts(self) -> dict[str, Any]:
        """The optimizers' state; sharded, this rank's shards as plain tensors (saved per rank)."""
        out = {"optimizer": _local_state(self.optimizer.state_dict())}
        if self.critic_opt is not None:
            out["critic_optimizer"] = _local_state(self.critic_opt.state_dict())
        return out

    def load_optimizer_state_dicts(self, state: dict[str, Any]) -> None:
        """Restore `optimizer_state_dicts` (same number of ranks: each takes back its shards)."""
        _load_optimizer(self.optimizer, state["optimizer"])
        if self.critic_opt is not None and "critic_optimizer" in state:
            _load_optimizer(self.critic_opt, state["critic_optimizer"])

    def sync_reference_to_policy(self) -> None:
        """The reference becomes the current policy (after the warm start)."""
        if self.reference is None:
            return
        with torch.no_grad():
            ref = self.reference.state_dict()
            for name, t in self.policy.state_dict().items():
                # same shapes, same mesh: shard by shard when sharded, no collective
                dst, src = ref[name], t
                if _is_sharded(dst):
                    dst, src = dst.to_local(), src.to_local()  # type: ignore[attr-defined]
                dst.copy_(src)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.policy.parameters())
