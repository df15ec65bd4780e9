"""A compiled vLLM-CPU engine that loads its compiled model from disk instead of compiling again.

With ``rollout.compile`` (``enforce_eager=False``) vLLM 0.32 compiles the model on a CPU in its
``DYNAMO_TRACE_ONCE`` mode with the plain Inductor backend, and with torch ≥ 2.10 it saves the
result as an AOT artifact (``VLLM_USE_AOT_COMPILE``, on by default) under
``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/rank_<r>_<dp>/model``, to load at
the next engine start with the same configuration. The save works; the load never did. After
``torch.compiler.load_compiled_function`` vLLM calls
``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)`` (``_try_load_aot_compiled_fn``
in ``vllm/compilation/decorators.py``), a method of its own ``VllmSerializableFunction``, which
wraps the piecewise backend GPUs use. Behind the Inductor backend the compiled function is
torch's ``BundledAOTAutogradSerializableCallable``, which has no such method, so every load
failed with "'function' object has no attribute 'finalize_loading'", logged as a warning at a
level yatt's workers do not print, and the engine compiled from the start again, and saved again.

For that callable there is nothing left to finalize: deserializing it already loaded the
compiled module (``deserialize_bundled_cache_entry``). ``install()`` gives it a
``finalize_loading`` that does nothing, so the load succeeds; vLLM then calls the loaded
function with the live module, which reads the weights the in-place update writes (a test
checks that output follows the weights through an engine loaded from the cache).

Measured on the Zen 4 EPYC (2026-12-07, 22:50-22:56 UTC, ``small`` model in bf16, one thread, the
artifact on disk, three starts of each interleaved, vLLM's import of 7.0-8.1 s timed apart): a
compiled engine started in 20.3-24.2 s compiling again and 5.9-6.3 s loading, against 2.7-3.1 s
for an eager one. The first engine of a configuration on a machine still compiles and saves the
artifact for the ones after it. ``YATT_VLLM_CPU_AOT=0`` leaves vLLM as it is (the A/B).
"""

from __future__ import annotations


def install() -> bool:
    """Let vLLM finish loading an Inductor-backed AOT artifact (once per process); False where it
    was already installed, or this torch's callable has its own ``finalize_loading``."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:  # an older torch: no AOT artifacts of this kind
        return False
    if "finalize_loading" in vars(BundledAOTAutogradSerializableCallable):
        return False

    def finalize_loading(self, vllm_config) -> None:
        """Nothing to do: deserializing the bundled cache entry loaded the compiled module."""

    BundledAOTAutogradSerializableCallable.finalize_loading = finalize_loading  # type: ignore[attr-defined]
    return True
