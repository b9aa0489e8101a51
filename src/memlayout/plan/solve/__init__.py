"""The choice (analysis): a captured graph and its costs as a two-label problem, and its exact
optimum by an s-t minimum cut."""
