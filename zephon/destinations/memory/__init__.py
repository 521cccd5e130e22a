"""The memory tier: each node's checkpoint files in host memory, copied to a peer node."""
