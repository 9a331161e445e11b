"""moment: out-of-core GNN training planned around a server's PCIe topology."""

__version__ = "0.1.0"
