"""The appliance's front end: gRPC gateway, Triton-protocol client, and the CPU engine server."""
