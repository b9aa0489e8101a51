"""memlayout.compile and the torch.compile backend (L2 plan): compiled runs of a plan, built on the pipeline."""
