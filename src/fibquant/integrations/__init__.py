"""Bridges to serving engines and model formats (optional: each imports its engine lazily)."""
