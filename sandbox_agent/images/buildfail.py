"""Why a task's image did not build, read from podman's output: the Dockerfile step that failed and, when an
unreachable host is the cause, that host (design §12).

    parse_build_failure(stdout, stderr) -> BuildFailure(step="RUN add-apt-repository ppa:deadsnakes/ppa",
                                                        host="ppa.launchpadcontent.net", cause="...")

Podman prints ``STEP n/m: INSTRUCTION`` on stdout as it goes and ``Error: building at STEP "...": ...`` (or
``Error: creating build container: IMAGE: image not known`` for a ``FROM`` it cannot find with
``--pull=never``) on stderr; a RUN step's own output (apt, curl, pip, git) goes to both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

IMAGE_BUILD_FAILED = "image_build_failed"  # the status/reason every report gives such a task

# the names of a host that could not be reached, as the usual tools print them (first match wins)
_HOST_PATTERNS = tuple(
    re.compile(p)
    for p in (
        r"Temporary failure resolving '([^']+)'",  # apt
        r"Could not resolve host: ([A-Za-z0-9.-]+)",  # curl, git
        r"Could not resolve '([^']+)'",  # older apt
        r"Could not connect to ([A-Za-z0-9.-]+):\d+",  # apt
        r"Cannot initiate the connection to ([A-Za-z0-9.-]+):\d+",  # apt
        r"Failed to fetch [a-z+]+://([A-Za-z0-9.-]+)",  # apt
        r"Unable to find the server at ([A-Za-z0-9.-]+)",  # add-apt-repository (httplib2)
        r"HTTPSConnectionPool\(host='([^']+)'",  # pip / requests
        r"HTTPConnectionPool\(host='([^']+)'",
        r"pinging container registry ([A-Za-z0-9.-]+)",  # podman pull
        r"lookup ([A-Za-z0-9.-]+)(?: on [^:]+:\d+)?: (?:no such host|server misbehaving|Temporary failure)",  # Go
        r"unable to access '[a-z]+://([A-Za-z0-9.-]+)",  # git
        r"getaddrinfo (?:ENOTFOUND|EAI_AGAIN) ([A-Za-z0-9.-]+)",  # npm
    )
)
_STEP_ERROR = re.compile(r'^Error: building at STEP "(.*)": ([^"\n]*)$', re.MULTILINE)
_STEP_LINE = re.compile(r"^STEP \d+/\d+: (.*)$", re.MULTILINE)
_NOT_KNOWN = re.compile(r"^Error: creating build container: (.*?): image not known", re.MULTILINE)
_ERROR_LINE = re.compile(r"^(?:Error|E|ERROR|error|fatal):? (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class BuildFailure:
    step: str | None  # the Dockerfile instruction that failed ("RUN apt-get update"), None if unknown
    host: str | None  # the host it could not reach, when that is the cause
    cause: str  # one line: what failed


def unreachable_host(text: str) -> str | None:
    """The first host ``text`` says could not be resolved or reached, else None."""
    for pat in _HOST_PATTERNS:
        m = pat.search(text)
        if m:
            return m.group(1).rstrip(".")
    return None


def parse_build_failure(stdout: str, stderr: str) -> BuildFailure:
    """Read a failed ``podman build``'s output: the failing step, the unreachable host if any, and one line
    saying what failed."""
    step: str | None = None
    cause = ""
    m = _STEP_ERROR.search(stderr)
    if m:
        step, cause = m.group(1), m.group(2)
    missing = _NOT_KNOWN.search(stderr)
    if missing:
        cause = f"image {missing.group(1)} is not available locally (and pulls are off)"
    if step is None:
        steps = _STEP_LINE.findall(stdout)
        step = steps[-1] if steps else None
    host = unreachable_host(stderr) or unreachable_host(stdout)
    if host is not None:
        cause = f"could not reach {host}" + (f" ({cause})" if cause else "")
    if not cause:
        errors = _ERROR_LINE.findall(stderr) or [x for x in stderr.strip().splitlines()[-1:]]
        cause = errors[-1].strip() if errors else "podman build failed"
    return BuildFailure(step=step, host=host, cause=cause[:300])
