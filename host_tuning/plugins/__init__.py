"""Subsystem plugins in the manner of tuned: each plans, applies, verifies and reverts itself."""
