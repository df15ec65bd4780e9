"""The sampled token's rank without a compile on the first generate, for small vocabularies.

Whenever a request asks for log-probs (yatt asks for the sampled token's, ``logprobs=0``), vLLM
0.32's sampler also counts, for each row, the tokens at least as likely as the sampled one
(``Sampler.gather_logprobs`` -> ``vllm.v1.sample.ops.logprobs.batched_count_greater_than``). That
function is under ``torch.compile`` with the platform's simple backend, Inductor on CPU, so the
engine's first generate compiles it in the engine's process: dynamo, Inductor's code cache and a
C++ build. Measured on the Zen 4 EPYC (2026-12-07, one thread): its first call took 10.8 s with
Inductor's on-disk cache cold (the first engine on a fresh machine: a run's first rollout took
13.2 s of the demo's 105 s) and 1.3 s with it warm (every engine after that), against 0.03 s for
the generate after it.

The compiled kernel earns its start-up where the vocabulary is large; at a small one the eager
count is as fast. Per call, compiled against eager (``(x >= v).sum(-1)``):

| rows x vocabulary | compiled | eager |
|---|---:|---:|
| 16 x 512 | 0.020 ms | 0.007 ms |
| 64 x 512 | 0.020 ms | 0.016 ms |
| 256 x 512 | 0.032 ms | 0.055 ms |
| 16 x 4,096 | 0.024 ms | 0.027 ms |
| 64 x 4,096 | 0.033 ms | 0.104 ms |
| 32 x 151,936 | 0.385 ms | 17.6 ms |

``install()`` puts a count in the sampler's module that runs eagerly for a CPU tensor of at most
``EAGER_MAX_VOCAB`` columns (yatt's tiny models have 258 tokens) and hands anything larger to
vLLM's compiled function, which then compiles on the first large call as before. Both give the
same counts, exactly: a comparison and an integer sum.
"""

from __future__ import annotations

from typing import Any

import torch

# above this many columns the compiled count is the faster by more than its start-up is worth
EAGER_MAX_VOCAB = 1024
_MARK = "_yatt_eager_small_vocab"


def install() -> bool:
    """Route vLLM's sampler's rank count through the eager path for small vocabularies (once per
    process); False where it was already installed or this vLLM has no such function."""
    from vllm.v1.sample import sampler

    compiled: Any = getattr(sampler, "batched_count_greater_than", None)
    if compiled is None or getattr(compiled, _MARK, False):
        return False

    def count(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[-1] <= EAGER_MAX_VOCAB:
            return (x >= values).sum(-1)
        return count.compiled(x, values)  # type: ignore[attr-defined]

    setattr(count, _MARK, True)
    count.compiled = compiled  # type: ignore[attr-defined]  # vLLM's own, for larger vocabularies
    sampler.batched_count_greater_than = count
    return True
