"""Slim runtime: loads an engine directory and runs generation. Imports numpy, never torch."""
