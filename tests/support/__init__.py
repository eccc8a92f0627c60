"""Shared test helpers and fixtures (tests never import each other's test modules)."""
