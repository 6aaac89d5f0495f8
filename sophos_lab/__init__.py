"""sophos_lab: a Jupyter teaching lab for durable LLM agents."""
