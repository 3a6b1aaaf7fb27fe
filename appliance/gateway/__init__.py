"""The gateway: the public gRPC API in front of the inference server.

server.py composes and runs the process; service.py holds the gRPC services; pipeline.py is the
request path as named stages; models.py loads what each served model needs; generation.py turns a
backend's token ids into text events; messages.py writes the public API's messages.
"""
