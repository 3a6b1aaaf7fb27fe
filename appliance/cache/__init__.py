"""Response cache: exact-match tiers (in-process L1, Redis L2) and single-flight for misses."""
