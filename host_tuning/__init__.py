"""host_tuning package."""
