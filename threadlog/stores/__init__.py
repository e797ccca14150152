"""The public stores of a `ThreadLog` (SPEC sections 4-11)."""
