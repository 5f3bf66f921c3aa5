"""What a user runs: the composition root (cli) and the commands."""
