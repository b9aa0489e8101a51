"""Candidates beyond one strided format per node: padded channels, blocked (mkldnn) chains,
compiled runtimes (``memlayout.compile``)."""
