"""Mixed precision (AMP): which 16-bit type autocast should use on this device, and whether it needs a GradScaler.

bf16 keeps fp32's 8-bit exponent, so gradients neither overflow nor underflow more than in fp32 and
no loss scaling is needed. fp16 has a 5-bit exponent: small gradients flush to zero unless the loss
is scaled up first (torch.amp.GradScaler) and the gradients scaled back before the step.

Native bf16 arithmetic arrived with NVIDIA's Ampere generation (compute capability 8.0: A100, RTX 30xx).
Older GPUs (V100 = 7.0, T4 = 7.5) can *store* bf16, and `torch.cuda.is_bf16_supported()` answers
True there by default because it counts emulation - but their bf16 matmuls and convolutions run
without tensor cores, several times slower than fp16. So the course asks for native support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NATIVE_BF16_CAPABILITY = (8, 0)  # Ampere (sm_80) and newer


@dataclass(frozen=True)
class AmpSettings:
    enabled: bool
    dtype: torch.dtype  # what autocast computes in (ignored when not enabled)
    use_grad_scaler: bool  # True for fp16 only

    @property
    def dtype_name(self) -> str:
        """'bf16', 'fp16' or 'off', for the configuration line a lab prints."""
        if not self.enabled:
            return "off"
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


def has_native_bf16(device: torch.device) -> bool:
    """True on a CUDA GPU whose tensor cores do bf16 (compute capability 8.0 or newer)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= NATIVE_BF16_CAPABILITY


def choose_amp(device: torch.device, enabled: bool) -> AmpSettings:
    """bf16 where the GPU does it natively, else fp16 with a GradScaler; nothing when AMP is off.

    The labs refuse --amp on the CPU before they get here (CPU autocast is a different lesson).
    """
    if not enabled:
        return AmpSettings(enabled=False, dtype=torch.bfloat16, use_grad_scaler=False)
    if has_native_bf16(device):
        return AmpSettings(enabled=True, dtype=torch.bfloat16, use_grad_scaler=False)
    return AmpSettings(enabled=True, dtype=torch.float16, use_grad_scaler=True)
