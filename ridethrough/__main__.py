"""``python -m ridethrough``."""

from ridethrough.cli import main

main()
