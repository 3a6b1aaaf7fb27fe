"""Plans, applies, verifies and reverts host settings for single-stream inference latency."""
