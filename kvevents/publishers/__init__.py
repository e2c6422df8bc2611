"""Engine side: event publishers and the CPU offloading manager."""
