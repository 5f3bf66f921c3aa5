"""The engines as rows of one table, and the owners of their start, restart and takeover."""
