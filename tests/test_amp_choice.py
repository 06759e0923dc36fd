"""ddp_course.amp.choose_amp: which autocast dtype --amp uses, on GPUs this machine does not have.

torch.cuda.get_device_capability is monkeypatched, so the choice for a V100 (7.0), a T4 (7.5), an
A100 (8.0) and an H100 (9.0) is checked on a CPU-only machine. (Lab 3's configuration line on the
CPU, `amp=off`, is checked on a real launch in tests/test_lab3_ddp.py.)
"""

import pytest
import torch

from ddp_course.amp import choose_amp, has_native_bf16

GPU = torch.device("cuda", 0)


@pytest.fixture
def capability(monkeypatch):
    """capability((major, minor)): make torch report a GPU of that compute capability."""

    def set_capability(major_minor):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: major_minor)

    return set_capability


@pytest.mark.parametrize("major_minor", [(7, 0), (7, 5)], ids=["V100", "T4"])
def test_gpus_without_native_bf16_get_fp16_and_a_grad_scaler(capability, major_minor):
    capability(major_minor)
    amp = choose_amp(GPU, enabled=True)
    assert (amp.enabled, amp.dtype, amp.use_grad_scaler, amp.dtype_name) == (True, torch.float16, True, "fp16")


@pytest.mark.parametrize("major_minor", [(8, 0), (8, 6), (9, 0)], ids=["A100", "RTX30xx", "H100"])
def test_ampere_and_newer_get_bf16_without_a_scaler(capability, major_minor):
    capability(major_minor)
    amp = choose_amp(GPU, enabled=True)
    assert (amp.enabled, amp.dtype, amp.use_grad_scaler, amp.dtype_name) == (True, torch.bfloat16, False, "bf16")


@pytest.mark.parametrize("major_minor", [(7, 0), (9, 0)])
def test_disabled_means_off_on_any_gpu(capability, major_minor):
    capability(major_minor)
    amp = choose_amp(GPU, enabled=False)
    assert (amp.enabled, amp.use_grad_scaler, amp.dtype_name) == (False, False, "off")


def test_the_cpu_has_no_native_bf16_and_never_asks_for_the_gpu(monkeypatch):
    def no_gpu_here(device=None):
        raise AssertionError("choose_amp asked a CPU device for its CUDA capability")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu_here)
    cpu = torch.device("cpu")
    assert not has_native_bf16(cpu)
    assert choose_amp(cpu, enabled=False).dtype_name == "off"
