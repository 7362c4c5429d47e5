"""Execution: launching real runs through torchrun, the per-rank worker loop, emulation of slow or small devices and memory tracking."""
