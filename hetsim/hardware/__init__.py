"""Hardware: devices, links and every `--cluster` form (emulated, CUDA, catalog, TOML)."""
