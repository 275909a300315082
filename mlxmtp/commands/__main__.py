"""`python -m mlxmtp.commands ...`: the `mlxmtp` command."""

from .main import main

main()
