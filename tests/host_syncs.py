"""The host-sync detector, for tests: `fivefold.observe.host_syncs` (also `bench/host_syncs.py`'s)."""

from fivefold.observe.host_syncs import HostSyncs

__all__ = ["HostSyncs"]
