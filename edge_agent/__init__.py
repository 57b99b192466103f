"""Device runtime: an agent that connects to its cell, runs the device role and publishes results."""
