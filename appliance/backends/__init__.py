"""Inference backends the gateway streams token ids from, and the Triton wire format they share."""
