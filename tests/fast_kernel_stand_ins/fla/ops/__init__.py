"""Stand-in for `fla.ops`."""
