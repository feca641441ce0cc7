"""Container images: podman set-up and builds (``build``), the Dockerfile reader (``dockerfile``), wheels
(``wheels``, ``wheelhouse``) and why a build failed (``buildfail``)."""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
