"""Stand-in for flash-linear-attention (see ../README.md)."""
