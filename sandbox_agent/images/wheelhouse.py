"""The base image's wheelhouse (what it holds, where) and the host cache that images and wheels are kept in.

Its own module because two sides need it and one imports the other: ``images`` builds the wheelhouse into
the base image (with ``wheels.download``), and ``wheels.verifier_wheels`` fetches only the pins a task's test
script asks for beyond it, into the same cache.
"""

from __future__ import annotations

import os
from pathlib import Path

# Kept in the image as a wheelhouse, so a task's test script installs its pinned pytest offline: uv/pip get
# UV_OFFLINE/UV_FIND_LINKS/PIP_FIND_LINKS in the verifier (images.OFFLINE_ENV). colorama/tomli/exceptiongroup
# are pytest's conditional dependencies, which a universal `uv add`/`uv lock` resolution needs as files too.
WHEELHOUSE = "/opt/t1async/wheels"
WHEELHOUSE_PACKAGES = ("pytest==8.4.1", "pytest-json-ctrf==0.3.5", "colorama", "tomli", "exceptiongroup")


def cache_dir() -> Path:
    """The host's cache for images and wheels (``T1_IMAGE_CACHE``), made if missing."""
    d = Path(os.environ.get("T1_IMAGE_CACHE", "/var/cache/t1async/images"))
    d.mkdir(parents=True, exist_ok=True)
    return d
