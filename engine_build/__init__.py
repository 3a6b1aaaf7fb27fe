"""engine_build package."""
