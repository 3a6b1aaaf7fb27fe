"""Read-only discovery of the host: topology, devices and current kernel settings."""
