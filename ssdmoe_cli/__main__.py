"""`python -m ssdmoe_cli ...` is the `ssdmoe` command."""

from ssdmoe_cli.main import main

main()
