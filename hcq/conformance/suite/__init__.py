"""The conformance suite: pytest modules run against the device given with --hcq-device (see hcq.conformance).
Every test uses only the public API and the device's capability record, and leaves the device idle and healthy."""
