"""What a failed pass means: out of memory (split the pass, else refuse the row), a dead device
(the process must go), or one head's failure (its own task answers 500)."""
from __future__ import annotations

import torch

from server.errors import ApiError


class OutOfMemory(ApiError):
    """A row that does not fit in device memory even in a pass of its own (503)."""

    def __init__(self, tokens: int, device: torch.device, cause: BaseException | str):
        super().__init__(503, "out_of_memory",
                         f"an input of {tokens} tokens does not fit in {device} memory even in a pass of its own "
                         f"({cause if isinstance(cause, str) else error_text(cause)}); "
                         "send a shorter input, or ask for truncation with a lower token limit")


class HeadFailed(ApiError):
    """A task's head raised during a pass: its answers for the pass's rows (500); the other tasks
    of the batch are answered."""

    def __init__(self, task: str, cause: str):
        super().__init__(500, "head_failed", f"task {task!r} failed on this input: {cause[:200]}", task=task)


def error_text(exc: BaseException) -> str:
    """'Type: first line' of an exception (what is kept of it once it is dropped)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# CUDA errors that leave the context unusable ("sticky"): every later call in the process fails, so
# the only recovery is a new process (cudaErrorIllegalAddress, cudaErrorAssert, cudaErrorLaunchFailure,
# cudaErrorIllegalInstruction, cudaErrorMisalignedAddress, cudaErrorInvalidPc, cudaErrorHardwareStackError,
# cudaErrorECCUncorrectable, and cuBLAS's report of a kernel that failed to run)
STICKY_DEVICE_ERRORS = (
    "an illegal memory access was encountered", "device-side assert triggered", "unspecified launch failure",
    "an illegal instruction was encountered", "misaligned address", "invalid program counter",
    "hardware stack error", "uncorrectable ECC error", "CUBLAS_STATUS_EXECUTION_FAILED",
)


def is_device_failure(exc: BaseException) -> bool:
    """A sticky CUDA error (see STICKY_DEVICE_ERRORS): torch raises them as RuntimeError (or its
    subclass torch.AcceleratorError) with the CUDA runtime's message in the text."""
    if not isinstance(exc, RuntimeError) or is_out_of_memory(exc):
        return False
    text = str(exc)
    return any(marker in text for marker in STICKY_DEVICE_ERRORS)
