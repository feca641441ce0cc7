"""Moved to t1async.testing.sampler, beside the other conformance kits; this import path keeps working."""

from t1async.testing.sampler import check_sampler

__all__ = ["check_sampler"]
