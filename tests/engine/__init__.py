"""Tests of the torch engine."""
