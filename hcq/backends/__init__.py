"""Device backends, one package each. The core finds them by name (`hcq.Device("CPU")` imports
`hcq.backends.cpu`) and never imports them itself."""
