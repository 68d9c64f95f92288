"""Development tools run from a source checkout (not part of the installed package): `python -m tools.fuzz`."""
