"""Integrations with orchestrators."""
