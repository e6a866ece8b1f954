"""What a run is pinned to: run-manifests (read, validate, write), kernel-flag profiles, the model hash. Torch-free."""
