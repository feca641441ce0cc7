"""The cluster CLI (``python -m t1async.cluster up|down|status|tail``) and its supervisor."""
