"""Pure-torch references: the test oracle and the `torch` backend (CPU, or any device as a fallback)."""
