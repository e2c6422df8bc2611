"""Engine side: event publishers and the CPU offloading manager."""

__all__: list[str] = []
