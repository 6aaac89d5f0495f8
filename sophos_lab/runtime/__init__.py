"""The durable agent: settings, storage, the graph, the run lifecycle. Imports nothing above it."""
