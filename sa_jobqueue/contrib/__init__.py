"""Integrations with frameworks; each module imports its framework, the core never does."""
