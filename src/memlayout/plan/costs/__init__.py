"""What each choice costs (analysis): every layout node timed in both formats, every
conversion, the SQLite cache they are kept in, and why a node drops channels-last."""
