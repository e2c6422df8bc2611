"""Router side: the subscriber SDK, the block index and the KV-aware router.

Never imports torch or :mod:`kvevents.publishers`.
"""

__all__: list[str] = []
