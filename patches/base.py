"""The generic family patch."""

from __future__ import annotations


class FamilyPatch:
    """Defaults for a family that uses transformers' attention interface and nothing unusual."""

    def unsupported_reason(self, config) -> str | None:
        """Why this configuration of the family cannot be accelerated, or None."""
        return None
