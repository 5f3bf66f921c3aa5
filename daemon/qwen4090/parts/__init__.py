"""The contracts of the parts the supervisor drives, and what it tells (status line, systemd)."""
