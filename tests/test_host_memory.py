"""server/host_memory.py: on glibc (this project's machines and images) the thresholds take."""
import platform

import pytest

from server.host_memory import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_keeps_freed_memory_and_a_second_call_is_harmless():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True
