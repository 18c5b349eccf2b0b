"""Resident memory of this process from /proc (Linux): current, peak, and resetting the peak."""

from __future__ import annotations


def status_bytes(key: str) -> int:
    """A size field of /proc/self/status ("VmRSS", "VmHWM", ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Set VmHWM (the peak RSS) to the current RSS and return that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")
