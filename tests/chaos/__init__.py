"""Chaos tests: real gateway processes killed, cut off from their store and out of disk, books kept by series."""
