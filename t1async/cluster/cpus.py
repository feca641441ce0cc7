"""CPU pinning for ``cluster up``'s components (``--learner-cpus``, ``--sampler-cpus``): taskset-style lists."""

from __future__ import annotations

import os
import shutil

from t1async.protocol.errors import ConfigError


def parse_cpus(spec: str, flag: str) -> set[int]:
    """A taskset-style CPU list ("0", "0,2", "1-3") as a set; every CPU must be one of the machine's."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"{flag} {spec!r}: not a CPU list; give e.g. 0 or 0,2 or 1-3") from None
    allowed = set(range(os.cpu_count() or 1))  # the machine's, not our own affinity (we may be pinned ourselves)
    if not cpus or not cpus <= allowed:
        raise ConfigError(
            f"{flag} {spec!r}: CPUs {sorted(cpus - allowed) or spec} are not on this machine; "
            f"it has {min(allowed)}-{max(allowed)}"
        )
    if shutil.which("taskset") is None:
        raise ConfigError(f"{flag} needs taskset (Debian package util-linux): apt-get install util-linux")
    return cpus


def pinned(argv: list[str], cpus: str) -> list[str]:
    """``argv`` run under ``taskset -c cpus`` (its threads, torch's pool included, see only those CPUs)."""
    return ["taskset", "-c", cpus, *argv] if cpus else argv
