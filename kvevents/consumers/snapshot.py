"""Index snapshots (moved to :mod:`kvevents.consumers.index.snapshot`; kept as an alias)."""

from kvevents.consumers.index.snapshot import SNAPSHOT_FORMAT, restore_index, snapshot_index

__all__ = ["SNAPSHOT_FORMAT", "restore_index", "snapshot_index"]
