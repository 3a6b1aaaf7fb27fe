"""Torch compute of the appliance engine server (imports torch; the gateway must not import it)."""
