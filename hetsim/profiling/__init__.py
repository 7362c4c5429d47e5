"""Profiling: device, block, memory and collective measurements, the profile store with its fingerprints, and the host-speed probe."""
