"""The node agent and its sources (probes, clock, NIC, GPU, job steps)."""
