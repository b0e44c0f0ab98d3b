"""Training the small demo checkpoints that ship in the package, on CPU (one module per family)."""
