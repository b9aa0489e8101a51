"""What runs (analysis): graphs of the model as torch.fx or torch.export captures them, with
every value's layout in ``node.meta``, and how much of the model they cover."""
